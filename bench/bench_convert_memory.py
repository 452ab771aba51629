"""Peak memory of the streaming Qwen v1 -> Qwen2 converter against shard size and total size.

Writes a synthetic v1 checkpoint (random bf16 weights in v1's layout, ~4 shards of ~200 MB by
default, as safetensors and as .bin), converts it in a fresh subprocess per run, and reports how far
the converter's resident set rose above its baseline.

Peak RSS is read from /proc/self/status (VmHWM) after resetting it through /proc/self/clear_refs
once the imports are done. `ru_maxrss` would also cover the image of the parent this process was
forked from (here: the bench, holding the synthetic weights), so it overstates a child's peak.
Linux only.

    python bench/bench_convert_memory.py [--layers 64] [--hidden 512] [--shard-mb 200]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
VOCAB = 151936

PROBE = """
import gc, json, sys, time
from pathlib import Path
from probdiff_callback.models import qwen_v1

def status_kib(field):
    return int(open("/proc/self/status").read().split(field + ":")[1].split()[0])

mode, src, dst, warm_src, warm_dst = sys.argv[1:6]
# Warm-up on a tiny checkpoint: every lazily imported module is loaded before the baseline.
qwen_v1._write_qwen2_shards(qwen_v1.v1_weight_files(Path(warm_src))[0], Path(warm_dst), 1 << 40, progress=False)
if mode == "full":
    import transformers, tokenizers  # noqa: F401  (imports are not the converter's memory)
    from transformers import Qwen2Config, GenerationConfig  # noqa: F401
    from transformers.convert_slow_tokenizer import TikTokenConverter  # noqa: F401
gc.collect()
with open("/proc/self/clear_refs", "w") as handle:
    handle.write("5")
before = status_kib("VmRSS")
start = time.perf_counter()
if mode == "weights":
    qwen_v1._write_qwen2_shards(qwen_v1.v1_weight_files(Path(src))[0], Path(dst), 1 << 40, progress=False)
else:
    qwen_v1.convert_qwen_checkpoint(src, dst, progress=False)
seconds = time.perf_counter() - start
growth = (status_kib("VmHWM") - before) * 1024
print(json.dumps({"growth_bytes": growth, "baseline_bytes": before * 1024, "seconds": seconds}))
"""


def v1_config(hidden: int, heads: int, layers: int, ffn: int) -> dict:
    return {
        "architectures": ["QWenLMHeadModel"], "model_type": "qwen", "hidden_size": hidden, "num_attention_heads": heads,
        "num_hidden_layers": layers, "intermediate_size": 2 * ffn, "kv_channels": hidden // heads,
        "layer_norm_epsilon": 1e-6, "rotary_emb_base": 10000, "rotary_pct": 1.0, "seq_length": 2048,
        "vocab_size": VOCAB, "use_dynamic_ntk": True, "use_logn_attn": True, "no_bias": True, "torch_dtype": "bfloat16",
    }  # fmt: skip


def v1_tensor_shapes(hidden: int, layers: int, ffn: int) -> list[tuple[str, tuple[int, ...]]]:
    shapes = [("transformer.wte.weight", (VOCAB, hidden))]
    for i in range(layers):
        p = f"transformer.h.{i}."
        shapes += [
            (p + "ln_1.weight", (hidden,)),
            (p + "attn.c_attn.weight", (3 * hidden, hidden)),
            (p + "attn.c_attn.bias", (3 * hidden,)),
            (p + "attn.c_proj.weight", (hidden, hidden)),
            (p + "ln_2.weight", (hidden,)),
            (p + "mlp.w1.weight", (ffn, hidden)),
            (p + "mlp.w2.weight", (ffn, hidden)),
            (p + "mlp.c_proj.weight", (hidden, ffn)),
        ]
    return shapes + [("transformer.ln_f.weight", (hidden,)), ("lm_head.weight", (VOCAB, hidden))]


def plan_shards(shapes: list[tuple[str, tuple[int, ...]]], shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    shards: list[list] = [[]]
    size = 0
    for key, shape in shapes:
        nbytes = 2 * int(torch.Size(shape).numel())
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((key, shape))
        size += nbytes
    return shards


def write_checkpoint(root: Path, config: dict, shards: list, fmt: str, seed: int = 0) -> list[int]:
    """One shard in memory at a time; returns each shard's size in bytes."""
    from safetensors.torch import save_file

    from probdiff_callback.models.tokenizer import bundled_tiktoken_file

    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config))
    shutil.copy(bundled_tiktoken_file(), root / "qwen.tiktoken")
    g = torch.Generator().manual_seed(seed)
    weight_map, sizes = {}, []
    for i, shard in enumerate(shards, start=1):
        tensors = {key: (0.02 * torch.randn(shape, generator=g)).to(torch.bfloat16) for key, shape in shard}
        stem = "model" if fmt == "safetensors" else "pytorch_model"
        name = f"{stem}-{i:05d}-of-{len(shards):05d}.{fmt}"
        if fmt == "safetensors":
            save_file(tensors, root / name, metadata={"format": "pt"})
        else:
            torch.save(tensors, root / name)
        sizes.append(sum(t.numel() * t.element_size() for t in tensors.values()))
        weight_map.update({key: name for key in tensors})
        del tensors
    index = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
    (root / index).write_text(json.dumps({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}))
    return sizes


def run_probe(mode: str, src: Path, dst: Path, warm: Path, work: Path) -> dict:
    for path in (dst, work / "warm-dst"):
        shutil.rmtree(path, ignore_errors=True)
    (work / "warm-dst").mkdir()
    if mode == "weights":
        dst.mkdir()
    result = subprocess.run(
        [sys.executable, "-c", PROBE, mode, str(src), str(dst), str(warm), str(work / "warm-dst")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    if result.returncode:
        raise RuntimeError(result.stderr)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=1408, help="Qwen2 intermediate_size (v1 stores twice this)")
    parser.add_argument("--shard-mb", type=float, default=200)
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where to write the checkpoints (default: a temp dir)"
    )
    args = parser.parse_args()

    work = args.workdir or Path(tempfile.mkdtemp(prefix="qwen-v1-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    config = v1_config(args.hidden, args.heads, args.layers, args.ffn)
    shards = plan_shards(v1_tensor_shapes(args.hidden, args.layers, args.ffn), int(args.shard_mb * 2**20))
    warm_config = v1_config(16, 2, 1, 16)
    warm_shards = plan_shards(v1_tensor_shapes(16, 1, 16), 1 << 40)
    try:
        rows = []
        for fmt in ("safetensors", "bin"):
            src, warm = work / f"v1-{fmt}", work / f"warm-{fmt}"
            sizes = write_checkpoint(src, config, shards, fmt)
            write_checkpoint(warm, warm_config, warm_shards, fmt)
            modes = ("weights", "full") if fmt == "safetensors" else ("weights",)
            for mode in modes:
                result = run_probe(mode, src, work / f"out-{fmt}-{mode}", warm, work)
                rows.append((fmt, mode, sizes, result))
        print(f"synthetic v1 checkpoint: hidden {args.hidden}, {args.layers} layers, vocab {VOCAB}, bf16")
        header = (
            f"{'input':<12}{'run':<9}{'shards':>7}{'largest MiB':>13}{'total MiB':>11}"
            f"{'peak MiB':>10}{'peak/shard':>12}{'peak/total':>12}{'sec':>7}"
        )
        print(header)
        print("-" * len(header))
        for fmt, mode, sizes, result in rows:
            peak, largest, total = result["growth_bytes"], max(sizes), sum(sizes)
            print(
                f"{fmt:<12}{mode:<9}{len(sizes):>7}{largest / 2**20:>13.0f}{total / 2**20:>11.0f}"
                f"{peak / 2**20:>10.0f}{peak / largest:>12.2f}{peak / total:>12.2f}{result['seconds']:>7.1f}"
            )
        print("peak = rise of VmHWM over the RSS after imports; 'full' adds config, tokenizer and generation config.")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
