"""The disagreement alarm during training: as soon as an independent measure (a reference metric, the eval loss) moves
against ProbDiff by a material amount at the pick (analysis/materiality.py), a warning on the console and a W&B alert,
once per disagreement; a significant change that is not material (a note, with its size) and a disagreement that a
paired test puts within noise are listed quietly (the log at info level). Main process only."""

from __future__ import annotations

import logging

from probdiff_callback.analysis.select import BY_CONFIDENCE
from probdiff_callback.core.config import DEFAULT_ALARM_GAIN_SHARE, DEFAULT_SUBDIR

logger = logging.getLogger(__name__)


class DisagreementAlerts:
    """As soon as an independent measure moves against ProbDiff: a warning on the console and a W&B alert, once per
    disagreement, for the material ones (`materiality.verdict`); the notes and the noise once, quietly."""

    def __init__(self) -> None:
        self.said: set = set()

    def announce(
        self,
        rows,
        run_dir: str,
        to_wandb: bool,
        subdir: str = DEFAULT_SUBDIR,
        gain_share: float = DEFAULT_ALARM_GAIN_SHARE,
        picked: int | None | object = BY_CONFIDENCE,
    ) -> None:
        from probdiff_callback.analysis.disagreement import format_alarm, format_notes, format_within_noise
        from probdiff_callback.analysis.select import disagreements

        new = [d for d in disagreements(rows, run_dir, subdir, gain_share, picked) if d not in self.said]
        if not new:
            return
        self.said.update(new)
        for quiet in (
            format_notes([d for d in new if d.verdict == "note"], gain_share),
            format_within_noise([d for d in new if d.verdict == "noise"]),
        ):
            if quiet:
                logger.info(quiet)
        loud = [d for d in new if d.verdict == "alarm"]
        if not loud:
            return
        text = format_alarm(loud, run_dir, gain_share)
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
