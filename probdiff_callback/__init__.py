"""ProbDiff self-evaluation for chat LLMs, as a library, a `transformers` callback and the `probdiff` CLI.

    from probdiff_callback import ProbDiffCallback, ProbDiffConfig, PreemptionCallback, evaluate, load_queries

The names are imported on first use, so `import probdiff_callback` (and the CLI's start) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {
    "ProbDiffCallback": "probdiff_callback.callback",
    "ProbDiffConfig": "probdiff_callback.config",
    "PreemptionCallback": "probdiff_callback.preemption",
    "evaluate": "probdiff_callback.evaluator",
    "load_queries": "probdiff_callback.queries",
    "load_model_and_tokenizer": "probdiff_callback.models",
}
__all__ = [
    "PreemptionCallback",
    "ProbDiffCallback",
    "ProbDiffConfig",
    "evaluate",
    "load_model_and_tokenizer",
    "load_queries",
]

if TYPE_CHECKING:
    from probdiff_callback.callback import ProbDiffCallback
    from probdiff_callback.config import ProbDiffConfig
    from probdiff_callback.evaluator import evaluate
    from probdiff_callback.models import load_model_and_tokenizer
    from probdiff_callback.preemption import PreemptionCallback
    from probdiff_callback.queries import load_queries


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'probdiff_callback' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
