"""The GPU kit's one command (docs/gpu.md): ProbDiff's evaluation and training on a model of Qwen-14B-Chat's shape
with random weights, against the hardware floor.

    python bench/gpu.py session [--cpu] [--parts "1 2 3"]   # a device session's whole work, its report in $OUT
    python bench/gpu.py bench [--shape qwen-14b] [--out D]   # the benchmark alone: its table, its report in D
    python bench/gpu.py wheels [--check]                     # the wheels a session carries (.whl/), sized
    python bench/gpu.py make-model DIR --shape S --layers N  # a session's step: a random model saved to DIR
    python bench/gpu.py env --out OUT                        # a session's step: what is there, from where

Its modules (bench/gpu_kit/): `session` runs the parts and `report` writes the one report (summary.md and .json);
`bench` measures, against `floor`; `model`: the workload, the model, the device; `wheels`. Each is imported only by
the command that needs it: `session` itself imports neither torch nor the package.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PATHS = ["ours", "generate", "generate-static", "generate-compile"]
SHAPES = ["qwen-14b", "qwen-7b", "tiny"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    session = commands.add_parser("session", help="a device session's whole work: every part, its report in $OUT")
    session.add_argument("--cpu", action="store_true", help="the same parts, small, on a CPU")
    session.add_argument("--parts", default="1 2 3", help='the parts after 0 ["1 2 3"]')
    session.add_argument("--seconds", type=int, default=None, help="the whole session's limit [gpu 500, cpu 1200]")
    session.add_argument("--layers", type=int, default=None, help="layers of the saved model [gpu 8, cpu 2]")
    add = commands.add_parser("bench", help="the benchmark: each decoding path against the floor").add_argument
    add("--shape", default="qwen-14b", choices=SHAPES, help="[qwen-14b]")
    add("--device", default=None, help="cuda, cuda:N or cpu [cuda when available]")
    add("--queries", type=int, default=None, help="queries per evaluation [recipe: 100; tiny: 4]")
    add("--max-new-tokens", type=int, default=None, help="per stage [recipe: 768; tiny: 8]")
    add("--batch-size", type=int, default=None, help="evaluation batch [recipe: 16; tiny: 4]")
    add("--decode-batch", type=int, nargs="*", help="one batch of each size; none: skip [16 32 64; tiny: 2 4]")
    add("--paths", nargs="+", default=PATHS, choices=PATHS, help=f"decoding paths [{' '.join(PATHS)}]")
    add("--out", default=None, help="the report's folder: OUT/summary.md and summary.json, rewritten as rows come")
    wheels = commands.add_parser("wheels", help="download the wheels a session carries; check them and the size")
    wheels.add_argument("--check", action="store_true", help="no download: check what is there")
    wheels.add_argument("--dir", default=str(Path(__file__).resolve().parents[1] / ".whl"), help="[.whl]")
    make = commands.add_parser("make-model", help="a random model of a shape saved to a folder")
    make.add_argument("folder", type=Path)
    make.add_argument("--shape", default="qwen-14b", choices=SHAPES)
    make.add_argument("--layers", type=int, default=None, help="decoder layers [the shape's]")
    commands.add_parser("env", help="what a session imports, from where; the GPU").add_argument("--out", required=True)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command in ("session", "env"):
        from gpu_kit import session

        return session.Session(args).main() if args.command == "session" else session.environment(args)
    if args.command == "wheels":
        from gpu_kit import wheels

        return wheels.run(args)
    if args.command == "make-model":
        from gpu_kit.model import make_model

        print("make-model: " + json.dumps(make_model(args.folder, args.shape, args.layers)), flush=True)
        return 0
    from gpu_kit import bench

    return bench.run(args)


if __name__ == "__main__":
    sys.exit(main())
