"""The Trainer integration: `ProbDiffCallback` (`probdiff`), when it evaluates (`schedule`), the model in training
evaluated across ranks (`distributed`), what it hands out (`outputs`), and a preemption's clean stop (`preemption`).

    from probdiff_callback.callback import ProbDiffCallback, PreemptionCallback
"""

from probdiff_callback.callback.preemption import PreemptionCallback
from probdiff_callback.callback.probdiff import ProbDiffCallback

__all__ = ["PreemptionCallback", "ProbDiffCallback"]
