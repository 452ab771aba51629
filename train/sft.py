"""Supervised fine-tuning (LoRA or full) with ProbDiff self-evaluation at every checkpoint.

    python train/sft.py recipe=blog model=tiny
    python train/sft.py [--config_file recipes/accelerate/<name>.yaml] recipe=blog [key=value ...]

The command lives in the package: probdiff_callback/training/command.py (what it checks and launches) and sft.py
(the training process's steps). See docs/configuration.md.
"""

import sys

from probdiff_callback.training.command import run

if __name__ == "__main__":
    sys.exit(run(sys.argv[1:], script=__file__))
