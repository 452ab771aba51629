"""The one seam through which a test makes a process fail as a real fault would, at moments it could never time from
outside: between an evaluation's answers and its revisions, after a step's records and before its history row, between
a checkpoint's weights and its trainer state. Production code neither imports nor calls it.

`PROBDIFF_FAULT=<place>[:<n>][=<fault>]` acts the n-th time (1 by default) the process gets to `place`. The fault is a
real signal sent to the process itself, `KILL` (the default: kill -9, the OOM killer, a node lost), `TERM` or `USR1` (a
preemption arriving there), or `OOM`, a `torch.OutOfMemoryError` raised there. Several faults are separated by commas.
With `PROBDIFF_FAULT_ONCE=<file>` a fault acts only in the first process to create that file: a process started again
after the fault (an evaluator restarted by training) inherits the plan but does not fail again.

A place is a boundary between public functions, wrapped here: a process that a test starts with `fault_env(plan)` in
its environment loads `fault_site/sitecustomize.py` at start-up, which wraps the boundaries as their modules load (the
training processes `accelerate launch` starts inherit it); a test in its own process calls `inject(plan, setattr)` with
pytest's `monkeypatch.setattr`, which undoes the wrapping.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.util
import inspect
import os
import re
import signal
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

FAULT_ENV = "PROBDIFF_FAULT"
ONCE_ENV = "PROBDIFF_FAULT_ONCE"
SITE = Path(__file__).resolve().with_name("fault_site")  # its sitecustomize.py loads this module
PLACES = {
    "answers-done": "an evaluation batch's answers generated, its revisions not yet (`generate_answers` returned)",
    "revisions-done": "an evaluation batch's revisions generated, not yet scored (its last `generate_revisions` "
    "returned)",
    "records-written": "a step's records file written, its history row not yet (the first `write_atomic` of a "
    "`RunFiles.add` with records returned)",
    "history-tmp-written": "the history's temporary file written, not yet renamed over the history (`write_atomic`'s "
    "`os.replace` onto the history file)",
    "checkpoint-weights-saved": "a checkpoint's weights saved, its optimizer and trainer state not yet "
    "(`Trainer.save_model` into `checkpoint-N` returned)",
}
FAULTS = ("KILL", "TERM", "USR1", "OOM")
CHECKPOINT_DIR = re.compile(r"^checkpoint-\d+$")  # transformers' PREFIX_CHECKPOINT_DIR-<step>

Patch = Callable[[object, str, object], None]  # setattr, or pytest's monkeypatch.setattr


def planned_faults(text: str) -> list[tuple[str, int, str]]:
    """(place, n, fault) for each comma-separated `place[:n][=fault]`; a ValueError names what is wrong."""
    planned = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        spec, _, fault = item.partition("=")
        place, _, nth = spec.partition(":")
        fault = fault.upper() or "KILL"
        if place not in PLACES or fault not in FAULTS or not (nth or "1").isdigit():
            raise ValueError(
                f"{FAULT_ENV}={text}: {item!r} is not <place>[:<n>][=<fault>]; places: {', '.join(PLACES)}; "
                f"faults: {', '.join(FAULTS)}"
            )
        planned.append((place, int(nth or 1), fault))
    return planned


def fault_env(plan: str) -> dict[str, str]:
    """The environment that arms `plan` in a process a test starts, and in the processes it starts in turn."""
    path = os.pathsep.join(filter(None, [str(SITE), os.environ.get("PYTHONPATH")]))
    return {FAULT_ENV: plan, "PYTHONPATH": path}


class Faults:
    """One process's plan and its visits to each place."""

    def __init__(self, plan: str) -> None:
        self.planned = planned_faults(plan)
        self.visits: Counter[str] = Counter()

    def reached(self, place: str) -> None:
        """Act out the fault planned for this visit to `place`, if any."""
        self.visits[place] += 1
        for planned_place, nth, fault in self.planned:
            if planned_place == place and nth == self.visits[place] and self.first_to_fail():
                if fault == "OOM":
                    import torch

                    raise torch.OutOfMemoryError(f"{FAULT_ENV}: out of memory at {place} (visit {nth})")
                os.kill(os.getpid(), signal.Signals[f"SIG{fault}"])

    @staticmethod
    def first_to_fail() -> bool:
        """Without PROBDIFF_FAULT_ONCE, always; with it, only for the process that creates its file."""
        marker = os.environ.get(ONCE_ENV)
        if not marker:
            return True
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True

    def modules(self) -> list[str]:
        """The modules whose boundaries the plan's places lie on."""
        return sorted({MODULE_OF[place] for place, _, _ in self.planned})


def arguments(function: Callable, args: tuple, kwargs: dict) -> dict:
    return inspect.signature(function).bind(*args, **kwargs).arguments


def evaluator_boundaries(evaluator, faults: Faults) -> Iterator[tuple[object, str, object]]:
    """Answers done: `generate_answers` returned; revisions done: the batch's last `generate_revisions` returned
    (round `config.n_revisions`; with no revision round, the answers)."""
    generate_answers, generate_revisions = evaluator.generate_answers, evaluator.generate_revisions

    @functools.wraps(generate_answers)
    def answers_then_fault(*args, **kwargs):
        generate_answers(*args, **kwargs)
        faults.reached("answers-done")
        if arguments(generate_answers, args, kwargs)["config"].n_revisions == 0:
            faults.reached("revisions-done")

    @functools.wraps(generate_revisions)
    def revisions_then_fault(*args, **kwargs):
        generate_revisions(*args, **kwargs)
        given = arguments(generate_revisions, args, kwargs)
        if given["round_"] == given["config"].n_revisions:
            faults.reached("revisions-done")

    yield evaluator, "generate_answers", answers_then_fault
    yield evaluator, "generate_revisions", revisions_then_fault


def run_files_boundaries(run_files, faults: Faults) -> Iterator[tuple[object, str, object]]:
    """Records written: the first `write_atomic` of a `RunFiles.add` with records (its records file) returned; the
    history's temporary file written: `write_atomic`'s `os.replace` onto the history file."""
    add, write_atomic, replace = run_files.RunFiles.add, run_files.write_atomic, os.replace
    writing = {"records": False, "history": False}

    @functools.wraps(add)
    def add_then_fault(*args, **kwargs):
        writing["records"] = arguments(add, args, kwargs)["records"] is not None
        try:
            return add(*args, **kwargs)
        finally:
            writing["records"] = False

    @functools.wraps(write_atomic)
    def write_then_fault(path, *args, **kwargs):
        writing["history"] = Path(path).name == run_files.HISTORY_FILE
        try:
            write_atomic(path, *args, **kwargs)
        finally:
            writing["history"] = False
        if writing["records"]:
            writing["records"] = False
            faults.reached("records-written")

    @functools.wraps(replace)
    def fault_then_replace(src, dst, *args, **kwargs):
        if writing["history"] and Path(dst).name == run_files.HISTORY_FILE:
            faults.reached("history-tmp-written")
        return replace(src, dst, *args, **kwargs)

    yield run_files.RunFiles, "add", add_then_fault
    yield run_files, "write_atomic", write_then_fault
    yield os, "replace", fault_then_replace


def trainer_boundaries(trainer_module, faults: Faults) -> Iterator[tuple[object, str, object]]:
    """A checkpoint's weights saved: `Trainer.save_model` into a `checkpoint-N` folder returned (the Trainer's
    checkpoint save calls it first, then writes the optimizer, scheduler, RNG and trainer state)."""
    trainer_class = trainer_module.Trainer
    save_model = trainer_class.save_model

    @functools.wraps(save_model)
    def save_then_fault(*args, **kwargs):
        save_model(*args, **kwargs)
        output_dir = arguments(save_model, args, kwargs).get("output_dir")
        if output_dir is not None and CHECKPOINT_DIR.match(Path(output_dir).name):
            faults.reached("checkpoint-weights-saved")

    yield trainer_class, "save_model", save_then_fault


BOUNDARIES = {
    "probdiff_callback.core.evaluator": evaluator_boundaries,
    "probdiff_callback.runs.run_files": run_files_boundaries,
    "transformers.trainer": trainer_boundaries,
}
MODULE_OF = {
    "answers-done": "probdiff_callback.core.evaluator",
    "revisions-done": "probdiff_callback.core.evaluator",
    "records-written": "probdiff_callback.runs.run_files",
    "history-tmp-written": "probdiff_callback.runs.run_files",
    "checkpoint-weights-saved": "transformers.trainer",
}


def wrap(module, faults: Faults, patch: Patch) -> None:
    for target, name, wrapper in BOUNDARIES[module.__name__](module, faults):
        patch(target, name, wrapper)


def inject(plan: str, patch: Patch = setattr) -> Faults:
    """Arm `plan` in this process now, importing the modules its places lie on (a test's own process; pass
    `monkeypatch.setattr` so that the wrapping is undone)."""
    faults = Faults(plan)
    for name in faults.modules():
        wrap(importlib.import_module(name), faults, patch)
    return faults


def inject_as_modules_load(plan: str) -> Faults:
    """Arm `plan` in a process starting up (`sitecustomize`): each module is wrapped right after it executes, before
    any other module imports its names, so that `from ... import score_chains` gets the wrapped function too."""
    faults = Faults(plan)
    for name in faults.modules():
        if name in sys.modules:
            wrap(sys.modules[name], faults, setattr)
        else:
            sys.meta_path.insert(0, AfterImport(name, functools.partial(wrap, faults=faults, patch=setattr)))
    return faults


class AfterImport(importlib.abc.MetaPathFinder):
    """Finds the module `name` as the other finders would, and runs `then(module)` once it has executed."""

    def __init__(self, name: str, then: Callable) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once; and `find_spec` below asks the others
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        execute, then = spec.loader.exec_module, self.then

        def execute_then_wrap(module) -> None:
            execute(module)
            then(module)

        spec.loader.exec_module = execute_then_wrap  # type: ignore[method-assign]
        return spec
