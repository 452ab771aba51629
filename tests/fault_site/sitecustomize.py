"""Run by Python at start-up in a process a fault test starts (`_faults.fault_env` puts this folder on PYTHONPATH, and
the processes it starts inherit it): with `PROBDIFF_FAULT` set, the fault seam `tests/_faults.py` wraps the plan's
places as their modules load. A plan it cannot read ends the process (exit status 2), where Python would only print
an error in `sitecustomize` and run on without faults."""

import importlib.util
import os
import sys
from pathlib import Path

if os.environ.get("PROBDIFF_FAULT"):
    spec = importlib.util.spec_from_file_location("_faults", Path(__file__).resolve().parents[1] / "_faults.py")
    seam = importlib.util.module_from_spec(spec)
    sys.modules["_faults"] = seam
    spec.loader.exec_module(seam)
    try:
        seam.inject_as_modules_load(os.environ["PROBDIFF_FAULT"])
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        os._exit(2)  # sys.exit here would be a fatal error in Python's start-up, with its traceback
