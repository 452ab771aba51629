"""The Trainer integration: `ProbDiffCallback` (`probdiff`), when it evaluates (`schedule`), the model in training
evaluated across ranks (`trainer_evaluation`, on `ranks` and `model_in_training`), what it hands out (`metrics`,
`wandb_records`, `alerts`, `cost`), and a preemption's clean stop (`preemption`).

    from probdiff_callback.callback import ProbDiffCallback, PreemptionCallback
"""

from probdiff_callback.callback.preemption import PreemptionCallback
from probdiff_callback.callback.probdiff import ProbDiffCallback

__all__ = ["PreemptionCallback", "ProbDiffCallback"]
