"""The GPU kit's modules; `bench/gpu.py` is its one command (its docstring lists them)."""
