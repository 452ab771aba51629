"""Why `probdiff eval` and train/sft.py leave busy cores alone: one decoding step of the `smollm2` preset (batch 8,
60 cached positions) at 1 thread and at all cores, on an idle machine and with other processes spinning, measured
side by side in one run. Also prints the thread count that `probdiff_callback.runtime.threads` picks in each situation.

Run: python bench/bench_threads.py [--busy 0,1,3] [--seconds 10]
"""

import argparse
import os
import subprocess
import sys
import time

import _side_by_side as harness

STEP = """
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
from transformers import AutoModelForCausalLM
from probdiff_callback.models import resolve_model_path
model = AutoModelForCausalLM.from_pretrained(resolve_model_path("smollm2")).eval()
with torch.no_grad():
    cache = model(torch.randint(0, 49152, (8, 60)), use_cache=True).past_key_values
    started, steps = time.perf_counter(), 0
    while time.perf_counter() - started < float(sys.argv[2]):
        model(torch.randint(0, 49152, (8, 1)), past_key_values=cache, use_cache=True)
        steps += 1
print((time.perf_counter() - started) / steps)
"""
PICK = (
    "from probdiff_callback.runtime.threads import configure_threads; print(*configure_threads(environ={}), sep=': ')"
)


def run(code: str, *arguments: str) -> str:
    """The last line `code` prints, in a process of its own that picks its threads by the rule (no OMP_NUM_THREADS)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return harness.run([sys.executable, "-c", code, *arguments], env).last_line


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--busy", default="0,1,3", help="spinning processes beside the measurement [0,1,3]")
    parser.add_argument("--seconds", type=float, default=10.0, help="decoding time per measurement [10]")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    harness.prepare_model("smollm2")
    print(f"{cores} cores; load average before {harness.load_average()}")
    print("busy processes | s/step at 1 thread | s/step at all cores | all / 1 | threads picked")
    for busy in [int(b) for b in args.busy.split(",")]:
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            time.sleep(1.0 if busy else 0.0)
            picked = run(PICK)
            one, every = (float(run(STEP, str(threads), str(args.seconds))) for threads in (1, cores))
        finally:
            for spinner in spinners:
                spinner.kill()
                spinner.wait()
        print(f"{busy:14d} | {one:18.3f} | {every:19.3f} | {every / one:7.2f} | {picked}")


if __name__ == "__main__":
    main()
