"""When the callback evaluates: the trigger count a resumed run continues from, and the Trainer's own save schedule
(a preemption's extra checkpoint is neither evaluated nor counted)."""

from __future__ import annotations

from types import SimpleNamespace

from probdiff_callback.callback.schedule import is_scheduled_save, triggers_before


def args(eval_strategy="steps", save_strategy="steps"):
    return SimpleNamespace(eval_strategy=eval_strategy, save_strategy=save_strategy)


def state(step, eval_steps=4, save_steps=4, max_steps=40, epoch=0.0):
    return SimpleNamespace(global_step=step, eval_steps=eval_steps, save_steps=save_steps, max_steps=max_steps,
                           epoch=epoch)  # fmt: skip


def test_a_resumed_run_counts_the_evaluations_before_it():
    # every=2 evaluates the 2nd, 4th, ... evaluation: resumed at step 12 (3 evaluations done), the next due is step 16
    assert triggers_before(args(), state(12)) == 3
    assert triggers_before(args(), state(13)) == 3
    assert triggers_before(args(eval_strategy="no"), state(10, save_steps=5)) == 2  # saves trigger it then
    assert triggers_before(args(eval_strategy="epoch"), state(30, epoch=2.0)) == 2
    assert triggers_before(args(), state(0)) == 0


def test_a_preemption_checkpoint_is_not_a_scheduled_save():
    assert is_scheduled_save(args(), state(8))
    assert not is_scheduled_save(args(), state(9))  # saved only because a signal asked
    assert is_scheduled_save(args(), state(40))  # the last step
    assert is_scheduled_save(args(save_strategy="epoch"), state(20, epoch=1.0))
    assert not is_scheduled_save(args(save_strategy="epoch"), state(21, epoch=1.05))
    assert not is_scheduled_save(args(save_strategy="no"), state(8))
