"""The evaluator's models: the base model, loaded once, and each request's weights put on it; with `use_vllm=true` one
vLLM engine for the base model, handed each request's weights.

A request's weights are the base model (the adapters disabled), a PEFT adapter (loaded onto the one base model, and
swapped for the next step's) or whole weights (loaded for the request, freed after). A new training start whose spec
names another model or engine loads them again.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from peft import PeftModel
from transformers import AutoModelForCausalLM

from probdiff_callback.core.config import ProbDiffConfig
from probdiff_callback.generation.choice import EngineChoice, architectures_of, choose_engine, parameters_of
from probdiff_callback.generation.vllm import EngineUnavailable, VLLMGeneration
from probdiff_callback.models import load_model_and_tokenizer, parse_dtype, peft_without_deprecated_alias_warning
from probdiff_callback.runs.queue import SPEC_FILE, EvaluatorSpec, Queue

ADAPTER_CONFIG = "adapter_config.json"
MODEL_CONFIG = "config.json"


def weights_gone(folder: Path, step: int) -> str | None:
    """Why `folder` holds no weights to evaluate, or None when it holds an adapter or a model."""
    if not folder.is_dir():
        why = f"{folder}: no such folder"
    elif not (folder / ADAPTER_CONFIG).is_file() and not (folder / MODEL_CONFIG).is_file():
        why = f"{folder} holds neither {ADAPTER_CONFIG} nor {MODEL_CONFIG}"
    else:
        return None
    return f"the weights of step {step} are gone ({why})"


def describe_weights(folder: Path | None) -> str:
    if folder is None:
        return "the base model"
    return "its adapter" if (folder / ADAPTER_CONFIG).is_file() else "its weights"


def adapter_in(folder: Path | None) -> Path | None:
    """`folder` where it holds a PEFT adapter, else None."""
    return folder if folder is not None and (folder / ADAPTER_CONFIG).is_file() else None


def model_key(spec: EvaluatorSpec) -> tuple:
    """What the base model is loaded from: a new training start that changes it loads it again."""
    return (spec.model, spec.dtype, spec.trust_remote_code)


class Weights:
    """The base model, loaded once, and the weights of each request put on it: none (the base model, with the
    adapters disabled once an adapter was loaded), a PEFT adapter (loaded onto the base model, the previous one
    deleted), or whole weights (loaded for the request, freed after)."""

    def __init__(self, base, tokenizer, *, key: tuple, device: str, dtype: str) -> None:
        self.base, self.tokenizer, self.key, self.device, self.dtype = base, tokenizer, key, device, dtype
        self.peft = None  # the PeftModel around `base`, once an adapter was loaded
        self.adapter: str | None = None  # the adapter on it now
        self.loaded = 0  # adapters loaded so far

    @classmethod
    def load(cls, spec: EvaluatorSpec, device: str) -> Weights:
        """The spec's base model (a folder or a preset), in its dtype, on `device`."""
        dtype = spec.dtype or "auto"
        extra = {"trust_remote_code": True} if spec.trust_remote_code else {}
        try:
            base, tokenizer = load_model_and_tokenizer(spec.model, dtype=dtype, device=device, **extra)
        except (FileNotFoundError, ValueError) as err:  # no such folder, not a model, not downloadable now
            raise FileNotFoundError(
                f"the base model {spec.model} ({SPEC_FILE}'s `model`): {err}. The evaluator loads the base model the "
                "run was trained from: run it where that folder is at the same path"
            ) from None
        return cls(base, tokenizer, key=model_key(spec), device=device, dtype=dtype)

    @contextlib.contextmanager
    def holding(self, folder: Path | None) -> Iterator[object]:
        """The model with `folder`'s weights (None: the base model's), for the length of the block."""
        if folder is None:
            with self.peft.disable_adapter() if self.peft is not None else contextlib.nullcontext():
                yield self.peft if self.peft is not None else self.base
        elif adapter_in(folder) is not None:
            yield self._with_adapter(folder)
        else:
            yield self._whole_weights(folder)  # freed when the evaluation lets it go

    def _with_adapter(self, folder: Path):
        self.loaded += 1
        name = f"queued{self.loaded}"  # a name of its own: a step queued again comes with new weights
        with peft_without_deprecated_alias_warning():
            if self.peft is None:
                self.peft = PeftModel.from_pretrained(self.base, str(folder), adapter_name=name)
            else:
                self.peft.load_adapter(str(folder), adapter_name=name)
                self.peft.set_adapter(name)
        if self.adapter is not None and self.adapter != name:
            self.peft.delete_adapter(self.adapter)
        self.adapter = name
        self.peft.to(self.device)
        self.peft.eval()
        return self.peft

    def _whole_weights(self, folder: Path):
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=parse_dtype(self.dtype))
        return model.to(self.device).eval()


class Loaded:
    """The base model and the engine that writes the texts (generation/choice.py; with vLLM, its engine): loaded when
    the first request needs them, kept for the next ones, loaded again only when a new training start's spec names
    another model or engine. `say` reports, the engine's choice among it."""

    def __init__(self, queue: Queue, device: str, say: Callable[[str], None]) -> None:
        self.queue, self.device, self.say = queue, device, say
        self.weights: Weights | None = None
        self.vllm: VLLMGeneration | None = None
        self.choice: EngineChoice | None = None
        self._engine_spec: EvaluatorSpec | None = None

    def for_spec(
        self, spec: EvaluatorSpec, config: ProbDiffConfig, queries: int
    ) -> tuple[Weights, VLLMGeneration | None, ProbDiffConfig]:
        """The spec's model, its engine, and `config` with `use_vllm` decided (for `queries` queries an evaluation)."""
        if self.weights is None or self.weights.key != model_key(spec):
            self.close()
            self.weights = None
            gc.collect()
            started = time.perf_counter()
            self.weights = Weights.load(spec, self.device)
            self.say(f"{spec.model} loaded in {time.perf_counter() - started:.1f}s on {self.device}")
        if self._engine_spec != spec:
            self.close()
            self.choice = self._choose(spec, config, queries)
            self._engine_spec = spec
        assert self.choice is not None
        return self.weights, self.vllm, self.choice.applied(config)

    def _choose(self, spec: EvaluatorSpec, config: ProbDiffConfig, queries: int) -> EngineChoice:
        """The engine for this training start's settings, on this process's device, said in one line; vLLM started
        where it is chosen. Where it cannot start, `use_vllm=true` stops the evaluator; `auto` takes HF."""
        assert self.weights is not None
        base = self.weights.base
        choice = choose_engine(config, parameters=parameters_of(base), architectures=architectures_of(base),
                               queries=queries, in_training_loop=False, on_gpu=self.device != "cpu")  # fmt: skip
        if choice.use_vllm:
            started = time.perf_counter()
            try:
                self.vllm = VLLMGeneration.start(
                    choice.applied(config),
                    base,
                    self.weights.tokenizer,
                    lora_rank=spec.lora_rank or 0,
                    scratch_parent=self.queue.folder,
                )
            except EngineUnavailable as err:
                if config.use_vllm is True:
                    raise
                choice = choice.fallen_back(str(err))
            else:
                self.say(f"vLLM ({config.vllm_mode}) ready in {time.perf_counter() - started:.1f}s")
        self.say(choice.line())
        return choice

    def close(self) -> None:
        """End this process's vLLM engine, if any."""
        vllm, self.vllm, self._engine_spec = self.vllm, None, None
        if vllm is not None:
            vllm.close()
