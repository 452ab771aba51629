"""One LoRA training step of the blog recipe (then QLoRA, where bitsandbytes and CUDA are present): time and
peak memory against the floor, and from them each evaluation's share of training time on the recipe's schedule."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from probdiff_callback.models.checkpointing import set_activation_checkpointing

from .device import allocated_memory, clock, guarded, memory_detail, reset_peak_memory
from .evaluation import Measured
from .floor import Hardware, ModelCost, training_floor
from .paths import PATHS
from .report import Figure, say, seconds
from .workload import Bench, training_batch


@dataclass
class TrainingStep:
    tokens: int
    sequence_seconds: float  # forward + backward of one sequence
    optimizer_seconds: float
    memory_detail: str
    memory_numbers: dict[str, float]

    def optimizer_step_seconds(self, sequences: int) -> float:
        return sequences * self.sequence_seconds + self.optimizer_seconds


def choose_loss(requested: str, device: torch.device) -> tuple[str, str]:
    """('trl' | 'plain', why). As train/sft.py: SFTTrainer's fused LM head on a GPU, the model's own
    cross-entropy on a CPU (same loss: mean over the assistant tokens)."""
    trl_here = importlib.util.find_spec("trl") is not None
    if requested == "trl" and not trl_here:
        raise SystemExit("error: --loss trl needs trl installed (pip install trl), or use --loss plain")
    if requested in ("trl", "plain"):
        return requested, "as asked (--loss)"
    if device.type != "cuda":
        return "plain", "on CPU train/sft.py uses the model's own cross-entropy"
    if not trl_here:
        return "plain", "trl is not installed: the model's cross-entropy, which materialises the logits trl's does not"
    return "trl", "trl's fused LM head, as SFTTrainer computes it on a GPU"


def lora_target_modules(lora: dict) -> str | list[str]:
    """peft's target_modules for a recipe's `lora` section: its shorthand `all-linear` (which also finds QLoRA's NF4
    layers), or the module names."""
    return "all-linear" if list(lora["target_modules"]) == ["all-linear"] else list(lora["target_modules"])


def linear_layer_names(model, lora: dict) -> list[str]:
    """The layer names the recipe's LoRA adapts in `model` (all-linear: every linear layer but the LM head)."""
    if lora_target_modules(lora) != "all-linear":
        return list(lora["target_modules"])
    head = model.get_output_embeddings()
    return sorted(
        {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if type(module) is torch.nn.Linear}
        - {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if module is head}
    )


def lora_training_steps(
    model, tokenizer, recipe: dict, lengths: Sequence[int], loss: str, device: torch.device, dtype: torch.dtype
) -> tuple[object, list[TrainingStep]]:
    """Time forward + backward of one sequence and one AdamW step, LoRA on the recipe's modules, activation
    checkpointing on. Returns the base model with the adapter removed again, and one result per length."""
    from peft import LoraConfig, get_peft_model

    lora = recipe["lora"]
    peft_model = get_peft_model(
        model,
        LoraConfig(
            r=lora["r"],
            lora_alpha=lora["alpha"],
            lora_dropout=lora["dropout"],
            target_modules=lora_target_modules(lora),
            bias="none",
            task_type="CAUSAL_LM",
        ),
    )
    base = peft_model.get_base_model()
    base.config.use_cache = False
    set_activation_checkpointing(base, True, {"use_reentrant": False})
    extra = {}
    if loss == "trl":
        from trl.trainer.utils import add_fused_lm_head

        # SFTTrainer adds it to the base model under the adapter, with these outputs (its logged metrics)
        add_fused_lm_head(base, outputs=("log_probs", "entropy", "is_top1"))
        extra = {"fused_lm_head": True}
    peft_model.train()
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trainable, lr=recipe["learning_rate"], weight_decay=recipe["weight_decay"], betas=(0.9, recipe["adam_beta2"])
    )
    repeats = 3 if device.type == "cuda" else 2
    # the run's dtype, not the model's now: prepare_model_for_kbit_training has cast QLoRA's embedding to fp32
    autocast_bf16 = recipe["bf16"] and dtype == torch.bfloat16
    results = []
    for n_tokens in lengths:
        batch = dict(zip(("input_ids", "labels"), (t.to(device) for t in training_batch(tokenizer, n_tokens))))

        def forward_backward(batch: dict[str, torch.Tensor] = batch) -> None:
            # With bf16: true the Trainer runs the forward under bf16 autocast (accelerate wraps it); without it
            # peft's fp32 adapters, and QLoRA's fp32 norms and embeddings, would turn activations to fp32.
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
                loss_value = peft_model(**batch, use_cache=False, **extra).loss
            loss_value.backward()

        forward_backward()  # warm-up, and the optimizer's states get created below
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        before = allocated_memory(device)
        reset_peak_memory(device)
        times = []
        for _ in range(repeats):
            started = clock(device)
            forward_backward()
            times.append(clock(device) - started)
        started = clock(device)
        optimizer.step()
        optimizer_seconds = clock(device) - started
        optimizer.zero_grad(set_to_none=True)
        detail, numbers = memory_detail(device, before)
        results.append(TrainingStep(n_tokens, sorted(times)[len(times) // 2], optimizer_seconds, detail, numbers))
    del optimizer, trainable
    if loss == "trl":
        del base.forward  # add_fused_lm_head set it on the instance; the class's forward comes back
    set_activation_checkpointing(base, False)
    base.config.use_cache = True
    model = peft_model.unload()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return model, results


def qlora_unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"QLoRA (bitsandbytes NF4) runs on CUDA only; this run is on {device.type}"
    if importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed (pip install bitsandbytes)"
    return None


def quantize_decoder_4bit(model, compute_dtype: torch.dtype) -> None:
    """The recipe's quantization=4bit on the model in place: every linear layer of the decoder blocks becomes a
    bitsandbytes NF4 layer with double quantization (the embedding and the LM head stay, as transformers keeps
    them), then peft's prepare_model_for_kbit_training, as train/sft.py calls it."""
    import bitsandbytes as bnb
    from peft import prepare_model_for_kbit_training

    for layer in model.model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear:
                    quantized = bnb.nn.Linear4bit(
                        child.in_features,
                        child.out_features,
                        bias=child.bias is not None,
                        compute_dtype=compute_dtype,
                        compress_statistics=True,
                        quant_type="nf4",
                        device="meta",
                    )
                    quantized.weight = bnb.nn.Params4bit(
                        child.weight.data,
                        requires_grad=False,
                        compress_statistics=True,
                        quant_type="nf4",
                        module=quantized,
                    )
                    quantized.bias = child.bias
                    quantized.weight.to(child.weight.device)  # Params4bit quantizes itself when moved to the GPU
                    parent.add_module(name, quantized)  # in the place of the linear layer
    torch.cuda.empty_cache()
    # Activation checkpointing is switched on by lora_training_steps, non-reentrant as the recipe's trainer does.
    prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def training_figures(
    label: str, steps: Sequence[TrainingStep], loss_note: str, sequences: int, cost: ModelCost, hardware: Hardware
) -> list[Figure]:
    figures = []
    for step in steps:
        floor = training_floor(cost, hardware, step.tokens)
        figures.append(
            Figure(
                f"{label}, {step.tokens} tokens",
                f"{seconds(step.sequence_seconds)} per sequence",
                f"forward + backward of 1 x {step.tokens} tokens (median of the timed runs), activation "
                f"checkpointing, loss: {loss_note}; floor {seconds(floor)}, {step.sequence_seconds / floor:.2f}x "
                f"the floor; AdamW step {seconds(step.optimizer_seconds)}; an optimizer step of {sequences} "
                f"sequences {seconds(step.optimizer_step_seconds(sequences))}; memory {step.memory_detail}",
                {
                    "sequence_s": step.sequence_seconds,
                    "floor_s": floor,
                    "ratio_to_floor": step.sequence_seconds / floor,
                    "optimizer_s": step.optimizer_seconds,
                    "optimizer_step_of_recipe_s": step.optimizer_step_seconds(sequences),
                    **step.memory_numbers,
                },
            )
        )
    return figures


def share_of_training(eval_seconds: float, step: TrainingStep, sequences: int, every: int) -> float:
    return eval_seconds / (eval_seconds + every * step.optimizer_step_seconds(sequences))


def share_figure(label: str, eval_seconds: float, steps: Sequence[TrainingStep], sequences: int, every: int) -> Figure:
    """Evaluation / (evaluation + the training between two evaluations), for each training length measured."""
    parts, numbers = [], {}
    for step in steps:
        share = share_of_training(eval_seconds, step, sequences, every)
        in_steps = eval_seconds / step.optimizer_step_seconds(sequences)
        parts.append(
            f"{100 * share:.1f}% at {step.tokens} tokens/sequence (an evaluation = {in_steps:.1f} optimizer steps)"
        )
        numbers[f"share_at_{step.tokens}_tokens"] = share
    headline = f"{100 * share_of_training(eval_seconds, steps[0], sequences, every):.1f}%"
    return Figure(
        f"{label}: share of training time",
        headline,
        f"evaluation every {every} optimizer steps of {sequences} sequences: " + "; ".join(parts),
        numbers,
    )


def training_section(bench: Bench, model, runs: dict[str, Measured]) -> list[Figure]:
    """The LoRA step, each evaluation's share of training time, then the QLoRA step (it quantizes the model)."""
    figures: list[Figure] = []
    recipe, lengths = bench.recipe, bench.workload.train_tokens
    sequences = recipe["per_device_train_batch_size"] * recipe["gradient_accumulation_steps"]
    loss, why = choose_loss(bench.args.loss, bench.device)
    loss_note = f"{'trl fused LM head' if loss == 'trl' else 'model cross-entropy'} ({why})"
    lora = recipe["lora"]
    label = f"LoRA step (r {lora['r']}, alpha {lora['alpha']}, {len(linear_layer_names(model, lora))} projections)"
    say(f"{label}: {', '.join(map(str, lengths))} tokens")

    def lora_steps(model=model) -> tuple[object, list[TrainingStep]]:
        return lora_training_steps(model, bench.tokenizer, recipe, lengths, loss, bench.device, bench.dtype)

    done = guarded(figures, label, bench.device, lora_steps)
    if done is None:
        figures.append(Figure("QLoRA step", "skipped", "the LoRA step ran out of memory"))
        return figures
    model, steps = done
    figures += training_figures(label, steps, loss_note, sequences, bench.cost, bench.hardware)
    for name, run in runs.items():
        figures.append(share_figure(PATHS[name], run.seconds, steps, sequences, recipe["eval_steps"]))

    reason = "skipped (--no-qlora)" if bench.args.no_qlora else qlora_unavailable(bench.device)
    if reason:
        figures.append(Figure("QLoRA step", "skipped", reason))
        return figures
    say("QLoRA step: quantizing the decoder to NF4 in place")

    def qlora() -> list[TrainingStep]:
        quantize_decoder_4bit(model, bench.dtype)
        return lora_steps(model)[1]

    steps = guarded(figures, "QLoRA step", bench.device, qlora)
    if steps is not None:
        label = "QLoRA step (NF4, double quantization)"
        figures += training_figures(label, steps, loss_note, sequences, bench.cost, bench.hardware)
    return figures
