"""Prepare the training and held-out data of a ProbDiff recipe: `python data/prepare.py <task> [options]`.

The command lives in the package, probdiff_callback/data/prepare.py (`--help` lists the options and sources).
"""

import sys

from probdiff_callback.data.prepare import main

if __name__ == "__main__":
    sys.exit(main())
