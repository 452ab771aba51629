"""The evaluation beside training (`async_eval`): training queues each step the loop would evaluate, an evaluator
process (`probdiff watch RUN_DIR`) evaluates it with the loop's code, and training logs the result at its own step.

- `queue`: the one module that knows the files between them (spec, requests, done marks, the end, the weights);
- `training`: training's side, the callback's way of evaluating with async_eval (`steps`: each step's stage;
  `late`: late results and the late best; `rotation`; `local`: the evaluator training starts on its node);
- `watch`: the `probdiff watch` command (`lock`: one evaluator per run) and its `loop`, with the models (`weights`)
  and the last evaluations on the cores training frees (`shares`).
"""
