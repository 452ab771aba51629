"""Named places where a test makes the process fail as a real fault would.

`PROBDIFF_FAULT=<place>[:<n>][=<fault>]` acts the n-th time (1 by default) this process gets to `place`. The fault
is a real signal sent to the process itself, `KILL` (the default: kill -9, the OOM killer, a node lost), `TERM` or
`USR1` (a preemption arriving there), or `OOM`, a `torch.OutOfMemoryError` raised there. Several faults are
separated by commas. Tests use it to hit moments they could never time from outside: between an evaluation's
answers and its revisions, after a step's records and before its history row, between a checkpoint's weights and
its trainer state. Unset (always, outside tests) a place costs one environment lookup.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

FAULT_ENV = "PROBDIFF_FAULT"
PLACES = {
    "answers-done": "an evaluation batch's answers generated, its revisions not yet",
    "revisions-done": "an evaluation batch's revisions generated, not yet scored",
    "records-written": "a step's records file written, its history row not yet",
    "history-tmp-written": "the history's temporary file written, not yet renamed over the history",
    "checkpoint-weights-saved": "a checkpoint's weights saved, its optimizer and trainer state not yet",
}
FAULTS = ("KILL", "TERM", "USR1", "OOM")
_reached: Counter[str] = Counter()


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


def reached(place: str) -> None:
    """Act out the fault `PROBDIFF_FAULT` plans for this visit to `place`, if any."""
    text = os.environ.get(FAULT_ENV)
    if not text:
        return
    _reached[place] += 1
    for planned_place, nth, fault in planned_faults(text):
        if planned_place == place and nth == _reached[place]:
            if fault == "OOM":
                import torch

                raise torch.OutOfMemoryError(f"{FAULT_ENV}: out of memory at {place} (visit {nth})")
            os.kill(os.getpid(), signal.Signals[f"SIG{fault}"])
