"""The disagreement alarm during training: as soon as an independent measure (a reference metric, the eval loss) moves
against ProbDiff, a warning on the console and a W&B alert, once per disagreement. Main process only."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class DisagreementAlerts:
    """As soon as an independent measure moves against ProbDiff: a warning on the console and a W&B alert, once per
    disagreement."""

    def __init__(self) -> None:
        self.said: set = set()

    def announce(self, rows, run_dir: str, to_wandb: bool) -> None:
        from probdiff_callback.analysis.disagreement import format_disagreements
        from probdiff_callback.analysis.select import disagreements

        new = [d for d in disagreements(rows, run_dir) if d not in self.said]
        if not new:
            return
        self.said.update(new)
        text = format_disagreements(new, run_dir)
        logger.warning(text)
        if to_wandb:
            try:
                alert_wandb("ProbDiff disagrees with an independent measure", text)
            except Exception:  # the console has it; a failed alert is not worth the run
                logger.exception("ProbDiff: sending the disagreement to W&B failed")


def alert_wandb(title: str, text: str) -> None:
    """A W&B alert (e-mail or Slack, as the user set it up) and the text in the run's summary, where the run page
    shows it."""
    import wandb

    if wandb.run is None:
        return
    previous = wandb.run.summary.get("probdiff/disagreement")
    wandb.run.summary["probdiff/disagreement"] = f"{previous}\n{text}" if previous else text
    wandb.run.alert(title=title, text=text, level=wandb.AlertLevel.WARN)
