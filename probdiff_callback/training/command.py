"""The training command users start, `python train/sft.py [accelerate launch options] recipe=NAME [key=value ...]`
(or, without a checkout, `python -m probdiff_callback.training ...`): the settings checked before the training stack is
imported, then training in this process, or `accelerate launch` of the training processes with this process as their
launcher (launch.py).

`recipe=NAME` reads recipes/NAME.yaml, or a path to a .yaml file; `key=value` overrides any of its keys (nested with
dots: `lora.r=8`, `probdiff.delta=-0.02`), and any trl.SFTConfig field can be set the same way (`optim=adafactor`).
Options before them are `accelerate launch`'s. See docs/configuration.md.
"""

from __future__ import annotations

import os

from probdiff_callback.training import launch, precheck

MODULE = "probdiff_callback.training"  # what `python -m` runs, and what the launcher runs again without a script


def run(argv: list[str], script: str | None = None) -> int:
    """The command: `argv` as typed after the script; `script`: the file it was started as (train/sft.py), which the
    training processes run again, or None for `python -m probdiff_callback.training`."""
    options, arguments = launch.split_arguments(argv)
    if script is None:  # the lines on how to go on name the command as it was started
        os.environ[launch.ENTRY_ENV] = f"python -m {MODULE}"
    launch.follow_launcher()  # before anything that takes time: a Ctrl-C then reaches the launcher only
    # a mistake in the settings is said before the imports below, which take seconds (tens on a loaded machine)
    if (status := precheck.refused(options, arguments)) is not None:
        return status
    if launch.needs_launcher(options):
        return launch.main(argv, script=script, module=MODULE if script is None else None)
    from probdiff_callback.training.sft import main

    return main(arguments)
