"""Work the whole test session shares, done once whichever pytest-xdist worker needs it first.

pytest-xdist runs a session- or module-scoped fixture once per worker: a reference training run that tests on both
workers read would be trained twice. `made_once` is the pattern of pytest-xdist's docs ("Making session-scoped
fixtures execute only once"): a folder beside the workers' own temporary folders, a file lock, the result kept on
disk for the other worker to read.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

MADE = ".made"  # written once `make` returned: the folder is whole


def made_once(tmp_path_factory, name: str, make: Callable[[Path], None]) -> Path:
    """The folder `make(folder)` filled, once per test session: the first worker to ask makes it while the other waits
    on the lock, then both read it (a test that changes what is there works on a copy). A `make` that failed (raised)
    leaves no result: the next test that asks tries again, and fails as that one did."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # xdist: <session>/popen-gw<N>
    folder = shared / f"once-{name}"
    with FileLock(str(shared / f"once-{name}.lock")):
        if not (folder / MADE).is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            (folder / MADE).touch()
    return folder
