"""ProbDiff self-evaluation for chat LLMs, as a library, a `transformers` callback and the `probdiff` CLI.

    from probdiff_callback import ProbDiffCallback, ProbDiffConfig, PreemptionCallback, evaluate, load_queries

The names are imported on first use, so `import probdiff_callback` (and the CLI's start) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {
    "ProbDiffCallback": "probdiff_callback.callback.probdiff",
    "ProbDiffConfig": "probdiff_callback.core.config",
    "PreemptionCallback": "probdiff_callback.callback.preemption",
    "evaluate": "probdiff_callback.core.evaluator",
    "load_queries": "probdiff_callback.core.queries",
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
    from probdiff_callback.callback.preemption import PreemptionCallback
    from probdiff_callback.callback.probdiff import ProbDiffCallback
    from probdiff_callback.core.config import ProbDiffConfig
    from probdiff_callback.core.evaluator import evaluate
    from probdiff_callback.core.queries import load_queries
    from probdiff_callback.models import load_model_and_tokenizer


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'probdiff_callback' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
