"""A `vllm serve` you started, as an engine (`ServerEngine`, vllm_mode=server): the HTTP client that sends it the
requests and reads the texts. TRL's server mode has the same two sides: the server is yours (another node, a job step
of its own), this is the client.

A request waits as long as the server is alive and making progress (`liveness.py`): its metrics; it fails once the
server cannot be reached or has stalled, with the texts finished so far in the error (`GenerationError.finished`).
Giving a wait up closes its connections, and vLLM aborts their requests.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import socket
import threading
import urllib.parse
from collections.abc import Callable, Sequence

from probdiff_callback.core.engine import Generated, GenerationRequest
from probdiff_callback.generation.liveness import ServerWatch
from probdiff_callback.generation.vllm_common import EngineUnavailable, decoded, sampling_settings

SERVER_ADAPTER_NAME = "probdiff"


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
    """A vLLM server you started (OpenAI-compatible completions with vLLM's `return_token_ids`): one HTTP request per
    text, sent together so the server batches them. Adapters are loaded by path through `/v1/load_lora_adapter`; the
    path must be readable by the server.

    Texts are waited for as long as the server is alive and making progress (`liveness.ServerWatch`): until its
    metrics show no work for `stall_timeout` seconds or it does not answer for `timeout` seconds. Every other request
    (the model list, loading an adapter) generates nothing to watch and is bounded by `timeout`, as is connecting.
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
    ) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.tokenizer, self.stop_ids, self.timeout, self.parallel = tokenizer, list(stop_ids), timeout, parallel
        self.watch = ServerWatch(self.metrics, stall_seconds=stall_timeout, answer_seconds=timeout)
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
        """Why a request got no answer: the server cannot be reached."""
        reason = str(err) or type(err).__name__
        return (
            f"vLLM server {self.base_url} cannot be reached ({reason}). Start it with `vllm serve <base model> "
            "--enable-lora` (docs/vllm.md), or set vllm_server_base_url=<its URL>"
        )

    def _gone(self, problem: str) -> str:
        """The error of a wait the watch gave up: what was seen and the setting that bounds it."""
        window = ""
        if problem.startswith("stalled"):
            window = f" (vllm_stall_timeout={self.watch.stall_seconds:g}: raise it where one step takes longer)"
        return f"vLLM server {self.base_url} {problem}{window}"

    # ---- which weights ----
    def use_base(self) -> None:
        self.model = self.base_model

    def use_adapter(self, path: str) -> None:
        body = {"lora_name": SERVER_ADAPTER_NAME, "lora_path": str(path), "load_inplace": True}
        self._call("POST", "/v1/load_lora_adapter", body)
        self.model = SERVER_ADAPTER_NAME

    def use_weights(self, weights) -> None:
        raise ValueError(
            "vllm_mode=server takes LoRA adapters only: it cannot receive whole weights (full fine-tuning). Train "
            "with LoRA, or use vllm_mode=colocate (vLLM in the evaluating process) or the HF engine (use_vllm=false)"
        )

    def sleep(self) -> None:
        """Nothing: a server you started keeps its own memory."""

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
        """Nothing to stop: the server is yours, and stays running."""
