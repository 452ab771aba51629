"""`python -m probdiff_callback.training recipe=NAME [key=value ...]`: the training command (command.py)."""

import sys

from probdiff_callback.training.command import run

sys.exit(run(sys.argv[1:]))
