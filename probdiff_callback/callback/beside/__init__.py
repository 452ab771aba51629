"""The evaluation beside training (`async_eval`), training's side: the callback's way of evaluating that queues each
step the loop would evaluate for an evaluator process (`probdiff watch RUN_DIR`, the `watch/` package) and logs the
result at its own step when it arrives.

- `training`: `BesideTraining`, the way itself (`spec`: what training tells the evaluator; `steps`: each step's
  stage; `late`: a result logged at its own step; `rotation`; `local`: the evaluator training starts on its node);
- the files between the two processes are `runs/queue.py`'s, the one module both import.
"""
