"""The device: wall time and memory on CUDA or CPU, its name and the versions measured, its memory bandwidth
and matmul throughput (the floor's hardware), and a measurement guarded against running out of memory."""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import os
import platform
import re
import resource
import subprocess
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from . import ROOT
from .floor import Hardware, ModelCost, cost_figures
from .report import GIB, Figure, gib, say


def clock(device: torch.device) -> float:
    """Wall time after the device has finished the work queued so far (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def allocated_memory(device: torch.device) -> float:
    """Bytes held by tensors now (CUDA only; 0 on CPU, where peak RSS includes everything)."""
    return float(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0.0


def memory_detail(device: torch.device, before: float) -> tuple[str, dict[str, float]]:
    """The peak since `reset_peak_memory`, in words and numbers. On CPU the peak RSS of the process cannot be reset,
    so it is the peak so far."""
    if device.type == "cuda":
        peak = float(torch.cuda.max_memory_allocated(device))
        words = f"{gib(peak)} peak allocated (torch.cuda.max_memory_allocated), {gib(peak - before)} above what was "
        return words + "held before", {"peak_memory_bytes": peak, "peak_above_before_bytes": peak - before}
    peak = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return f"{gib(peak)} (CPU: peak RSS of the process so far)", {"peak_rss_bytes": peak}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        return f"{properties.name}, {gib(properties.total_memory)}, CUDA {torch.version.cuda}"
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        names = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")]
        model = names[0].split(":", 1)[1].strip() if names else model
    return f"CPU: {model}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def versions() -> str:
    """Python's and the packages' versions, and this checkout's: the kit imports the library from here."""
    parts = [f"python {platform.python_version()}"]
    for name in ("torch", "transformers", "peft", "trl", "bitsandbytes"):
        try:
            parts.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{name} not installed")
    found = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    parts.append(f"probdiff {found.group(1) if found else 'unknown'}")
    with contextlib.suppress(OSError):  # no git on the machine: a copied checkout
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        parts[-1] += f" ({commit.stdout.strip()})" if commit.returncode == 0 else ""
    return ", ".join(parts)


def best_rate(work: Callable[[], None], amount: float, device: torch.device, runs: int, repeats: int) -> float:
    """`amount` per second of `work`, the best of `runs` runs of `repeats` calls, after one call of warm-up."""
    work()
    best = 0.0
    for _ in range(runs):
        started = clock(device)
        for _ in range(repeats):
            work()
        best = max(best, amount * repeats / (clock(device) - started))
    return best


def copy_rate(device: torch.device, n_bytes: int, copies: int) -> float:
    source = torch.empty(n_bytes, dtype=torch.uint8, device=device).fill_(1)
    target = torch.empty_like(source)
    return best_rate(lambda: target.copy_(source), 2 * n_bytes, device, runs=5, repeats=copies)


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int, products: int) -> float:
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return best_rate(lambda: a @ b, 2 * n**3, device, runs=3, repeats=products)


def hardware_section(device: torch.device, dtype: torch.dtype, cost: ModelCost) -> tuple[Hardware, list[Figure]]:
    """The memory bandwidth (a device-to-device copy, reads and writes counted) and the matmul rate of a large square
    matmul in the model's dtype, each the best of several runs."""
    say(f"device {device_name(device)}; measuring bandwidth and matmul throughput")
    on_gpu = device.type == "cuda"
    (n_bytes, copies), (n, products) = ((2 * GIB, 10), (8192, 20)) if on_gpu else ((256 * 1024**2, 3), (1024, 3))
    bandwidth, flops = copy_rate(device, n_bytes, copies), matmul_rate(device, dtype, n, products)
    return Hardware(bandwidth, flops), [
        Figure(
            "memory bandwidth",
            f"{bandwidth / 1e9:.1f} GB/s",
            f"best of 5 runs of {copies} copies of {gib(n_bytes)} (read + write counted)",
            {"bandwidth_bytes_per_s": bandwidth},
        ),
        Figure(
            "matmul throughput",
            f"{flops / 1e12:.2f} TFLOP/s",
            f"best of 3 runs of {products} {n}x{n} @ {n}x{n} matmuls in {str(dtype).removeprefix('torch.')}",
            {"flops_per_s": flops},
        ),
        *cost_figures(cost),
    ]


def guarded(figures: list[Figure], name: str, device: torch.device, measurement: Callable[[], object]) -> object:
    """The measurement's result, or None and a row saying why not: a batch that does not fit is a result too,
    and one failing path (a torch.compile error, say) should not cost the rest of a long GPU run."""
    try:
        return measurement()
    except torch.OutOfMemoryError as err:
        value, detail = "out of memory", str(err).splitlines()[0]
    except Exception as err:  # reported in the table and on stderr; then the next measurement
        traceback.print_exc()
        value, detail = "failed", f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    # Only here, outside the except clauses, are the failed call's frames and their tensors gone.
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    figures.append(Figure(name, value, detail))
    return None
