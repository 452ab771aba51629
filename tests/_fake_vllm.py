"""A stand-in for a vLLM OpenAI server, for the engine's waiting rules without vLLM: `/v1/models`, `/v1/completions`
(token ids derived from the prompt and seed, after `answer_after` seconds) and `/metrics` in Prometheus' text format,
with vLLM's metric names. Its counters advance while requests run, unless it stalls.

In a test's thread: `FakeVLLM(...)` as a context manager. As a process of its own (a server "this job started"):
`python tests/_fake_vllm.py PORT --exit-on-completion N` exits with status 3 at its N+1-th completion request, after a
line in its log; `--start-after S --log-every E` starts listening after S seconds, writing a line to its log every E
seconds until then (E=0: one line, then silence), as vLLM logs the stages of its start.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import select
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LABELS = '{engine="0",model_name="base model"}'  # a label value with a space, as a served model's path may have


def token_ids(prompt: list[int], seed: int) -> list[int]:
    """The fake's text for a request: a function of its prompt and seed only, as vLLM's is of a seeded request."""
    return [100 + (sum(prompt) * 31 + seed * 7 + i * 13) % 900 for i in range(3 + seed % 5)]


@dataclass
class Behaviour:
    answer_after: float = 0.0  # seconds before a completion is answered
    answered: int | None = None  # completions answered before the server stalls (None: all)
    exit_on_completion: int | None = None  # the process exits at this many completions plus one


class FakeVLLM:
    def __init__(self, behaviour: Behaviour | None = None, port: int = 0) -> None:
        self.behaviour = behaviour or Behaviour()
        self.lock = threading.Lock()
        self.completions = 0  # completion requests received
        self.running = 0
        self.generated = 0.0  # vllm:generation_tokens_total
        self.aborted = 0  # requests whose client went away before the answer
        self.stalled = threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeVLLM:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def metrics(self) -> str:
        with self.lock:
            if self.running and not self.stalled.is_set():
                self.generated += 1  # a token per look while requests run: progress
            rows = [
                "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
                "# TYPE vllm:generation_tokens_total counter",
                f"vllm:generation_tokens_total{LABELS} {self.generated}",
                f"vllm:prompt_tokens_total{LABELS} 0.0",
                'vllm:request_success_total{engine="0",finished_reason="stop",model_name="base model"} 0.0',
                f"vllm:num_requests_running{LABELS} {float(self.running)}",
                f"vllm:num_requests_waiting{LABELS} 0.0",
                'vllm:iteration_tokens_total_bucket{le="1.0",model_name="base model"} 3.0',
            ]
        return "\n".join(rows) + "\n"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _answer(self, value: dict | str) -> None:
                body = (value if isinstance(value, str) else json.dumps(value)).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._answer({"data": [{"id": "base"}]})
                elif self.path == "/metrics":
                    self._answer(fake.metrics())
                else:
                    self.send_error(404)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/completions":
                    self._answer("ok")
                    return
                behaviour = fake.behaviour
                with fake.lock:
                    number = fake.completions
                    fake.completions += 1
                    fake.running += 1
                try:
                    if behaviour.exit_on_completion is not None and number >= behaviour.exit_on_completion:
                        print("fake engine: the worker ran out of memory", flush=True)
                        os._exit(3)
                    stalls = behaviour.answered is not None and number >= behaviour.answered
                    if stalls:
                        fake.stalled.set()
                    if not self._wait(math.inf if stalls else behaviour.answer_after):
                        with fake.lock:
                            fake.aborted += 1
                        return
                    ids = token_ids(body["prompt"], body["seed"])
                    self._answer({"choices": [{"token_ids": ids, "finish_reason": "stop"}]})
                finally:
                    with fake.lock:
                        fake.running -= 1

            def _wait(self, seconds: float) -> bool:
                """Whether `seconds` passed with the client still there (False: it closed the connection)."""
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline:
                    readable, _, _ = select.select([self.connection], [], [], 0.05)
                    if readable and not self.connection.recv(1, socket.MSG_PEEK):
                        return False
                return True

        return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--exit-on-completion", type=int, default=None)
    parser.add_argument("--start-after", type=float, default=0.0)
    parser.add_argument("--log-every", type=float, default=0.0)
    args = parser.parse_args()
    start = time.monotonic()
    stage = 0
    while time.monotonic() - start < args.start_after:
        if stage == 0 or args.log_every > 0:
            print(f"fake engine: starting, stage {stage}", flush=True)
            stage += 1
        time.sleep(args.log_every if args.log_every > 0 else args.start_after)
    fake = FakeVLLM(Behaviour(exit_on_completion=args.exit_on_completion), port=args.port)
    print(f"fake engine: listening on {fake.url}", flush=True)
    fake.server.serve_forever()


if __name__ == "__main__":
    main()
