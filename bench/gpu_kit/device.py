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


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device) -> float:
    """Wall time after the device has finished the work queued so far (CUDA runs asynchronously)."""
    synchronize(device)
    return time.perf_counter()


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> tuple[float, str]:
    """(bytes, what they are). On CPU the peak RSS of the process cannot be reset, so it is the peak so far."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device)), "peak allocated (torch.cuda.max_memory_allocated)"
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024), "CPU: peak RSS of the process so far"


def allocated_memory(device: torch.device) -> float:
    """Bytes held by tensors now (CUDA only; 0 on CPU, where peak RSS includes everything)."""
    return float(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0.0


def memory_detail(device: torch.device, before: float) -> tuple[str, dict[str, float]]:
    peak, what = peak_memory(device)
    if device.type == "cuda":
        return f"{gib(peak)} {what}, {gib(peak - before)} above what was held before", {
            "peak_memory_bytes": peak,
            "peak_above_before_bytes": peak - before,
        }
    return f"{gib(peak)} ({what})", {"peak_rss_bytes": peak}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        return f"{properties.name}, {gib(properties.total_memory)}, CUDA {torch.version.cuda}"
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"CPU: {model}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def checkout_version() -> str:
    """This checkout's version and commit: the kit imports the library from here, installed or not."""
    match = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    version = match.group(1) if match else "unknown"
    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
    except OSError:  # no git on the machine: a copied checkout
        return f"probdiff {version}"
    return f"probdiff {version}" + (f" ({commit.stdout.strip()})" if commit.returncode == 0 else "")


def versions() -> str:
    import transformers

    parts = [
        f"python {platform.python_version()}",
        f"torch {torch.__version__}",
        f"transformers {transformers.__version__}",
    ]
    for name in ("peft", "trl", "bitsandbytes"):
        parts.append(f"{name} {package_version(name) or 'not installed'}")
    return ", ".join(parts + [checkout_version()])


def measure_bandwidth(device: torch.device) -> tuple[float, str]:
    """Bytes per second of a large device-to-device copy, reads and writes counted; the best of several."""
    n_bytes = 2 * GIB if device.type == "cuda" else 256 * 1024**2
    source = torch.empty(n_bytes, dtype=torch.uint8, device=device).fill_(1)
    target = torch.empty_like(source)
    target.copy_(source)  # warm-up: first touch of the pages, kernel load
    best = 0.0
    repeats = 10 if device.type == "cuda" else 3
    for _ in range(5):
        started = clock(device)
        for _ in range(repeats):
            target.copy_(source)
        best = max(best, 2 * n_bytes * repeats / (clock(device) - started))
    del source, target
    return best, f"best of 5 runs of {repeats} copies of {gib(n_bytes)} (read + write counted)"


def measure_matmul(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """FLOP/s of a large square matmul in the model's dtype; the best of several."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up: library initialisation, kernel selection
    best = 0.0
    repeats = 20 if device.type == "cuda" else 3
    for _ in range(3):
        started = clock(device)
        for _ in range(repeats):
            a @ b
        best = max(best, 2 * n**3 * repeats / (clock(device) - started))
    del a, b
    return best, f"best of 3 runs of {repeats} {n}x{n} @ {n}x{n} matmuls in {str(dtype).removeprefix('torch.')}"


def hardware_section(device: torch.device, dtype: torch.dtype, cost: ModelCost) -> tuple[Hardware, list[Figure]]:
    say(f"device {device_name(device)}; measuring bandwidth and matmul throughput")
    bandwidth, bandwidth_how = measure_bandwidth(device)
    flops, flops_how = measure_matmul(device, dtype)
    return Hardware(bandwidth, flops), [
        Figure("memory bandwidth", f"{bandwidth / 1e9:.1f} GB/s", bandwidth_how, {"bandwidth_bytes_per_s": bandwidth}),
        Figure("matmul throughput", f"{flops / 1e12:.2f} TFLOP/s", flops_how, {"flops_per_s": flops}),
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
