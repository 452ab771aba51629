"""`probdiff watch RUN_DIR`: the evaluator process of a run trained with `async_eval`, a package of its own (training's
side is `callback/beside/`; the files between them are `runs/queue.py`'s, the one module both import).

- `command`: the command (the checks before anything loads, the lock, stop signals); `lock`: one evaluator per run;
- `loop`: each pending request evaluated as the training loop would and recorded: the history's row and records (the
  evaluator is the history's one writer with async_eval), then the done mark that carries the row to training;
- `weights`: the base model loaded once, each request's weights put on it, the vLLM engine; `shares`: the last
  evaluations on the cores training frees.
"""
