"""A `probdiff` command's model loaded into this process: torch's CPU threads set first and, where the process is
the command's own (the console script's), freed memory kept for reuse on CPU and the garbage collector, paused while
loading, back on after it (`cli.entry_point` pauses it)."""

from __future__ import annotations

import gc
import sys
import time


def reuse_freed_memory() -> None:
    """Let glibc keep freed memory for reuse instead of returning it to the OS.

    By default large blocks (every [batch, 152k] logits tensor on CPU) are fresh mmap
    pages that fault in on first touch, each decoding step again (jemalloc/tcmalloc keep
    them too; PyTorch's CPU tuning guide recommends them).
    The process keeps its peak memory until it exits.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # from malloc.h
        libc.mallopt(m_mmap_threshold, 1 << 30)
        libc.mallopt(m_trim_threshold, (1 << 31) - 1)
    except (OSError, AttributeError):  # not glibc (e.g. musl): keep the defaults
        pass


def load_model(args, own_process: bool):
    """Model and tokenizer of `args` (--model, --adapter, --dtype, --device). In a process of its own (`own_process`:
    the console script's) the garbage collector, paused for the imports, comes back on with everything loaded so far
    frozen out of its passes."""
    started = time.time()
    from probdiff_callback.models import ModelUnavailable

    try:
        from probdiff_callback.models import default_device, load_model_and_tokenizer

        device = args.device or default_device()
        if device == "cpu":
            from probdiff_callback.runtime.threads import configure_threads

            threads, why = configure_threads()
            print(f"{threads} CPU thread{'s' if threads > 1 else ''} ({why})", file=sys.stderr)
        if own_process and device == "cpu":  # on GPU runs the host memory of loading would stay
            reuse_freed_memory()
        model, tokenizer = load_model_and_tokenizer(args.model, adapter=args.adapter, dtype=args.dtype, device=device)
    except ModelUnavailable as err:
        raise ModelUnavailable(f"--model {args.model}: {err}") from None
    finally:
        if own_process:
            gc.freeze()
            gc.enable()
    print(
        f"Loaded {args.model}{' + ' + args.adapter if args.adapter else ''} in {time.time() - started:.1f}s",
        file=sys.stderr,
    )
    return model, tokenizer
