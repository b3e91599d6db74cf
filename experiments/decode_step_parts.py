"""Where one layer's fused decode step spends its time, call after call: the Python around the kernel and the
kernel's passes.

The store is `benchmarks/decode.py --step`'s (synthetic heavy-tailed keys and values, the recipe's middle layer).
For each method and context the step (append one token, attend, crop back) runs back to back for `--seconds`,
first with wall-clock timers around the store's `append` and `view`, the kernel's inputs (`kernel_inputs`) and
its compiled entry (`_attend`); then once more with `_attend` run as Python (`py_func`) so that each compiled
pass it calls (`key_scores`, `value_sums`, the outlier and sink passes, ...) can be timed on its own. The
Python version's own loops are slower than the compiled ones, so only the passes' times are kept from it.
Medians in microseconds.

    python experiments/decode_step_parts.py [--methods nuq3-1%,nuq@3.5:r32:chan] [--contexts 256,2048,8192,32768]
        [--json experiments/results/decode_step_parts.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import DEFAULT_RECIPE, decode_machine, decode_step, prepare, step_inputs  # noqa: E402

import kvsqueeze.kernels.numba.attend as A  # noqa: E402
from kvsqueeze.cache.store import KVStore  # noqa: E402

PASSES = ("key_scores", "key_outliers", "sink_scores", "row_max", "value_sums", "value_outliers",
          "value_outliers_fixed", "sink_values")
TIMES: dict[str, list[float]] = {}


def timed(name, f):
    def call(*a, **k):
        t0 = time.perf_counter()
        out = f(*a, **k)
        TIMES.setdefault(name, []).append(1e6 * (time.perf_counter() - t0))
        return out
    return call


def python_lanes():
    """Stand-ins for the vector intrinsics `_attend` calls outside its passes, for its Python version."""
    A.vload = lambda a, i: np.array(a[i:i + A.LANES])
    A.vadd = lambda x, y: x + y
    A.vhsum = lambda v: v.sum()


def run(step, seconds: float) -> int:
    TIMES.clear()
    for _ in range(5):
        step()
    TIMES.clear()
    n, until = 0, time.perf_counter() + seconds
    while time.perf_counter() < until:
        step()
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="nuq3-1%,nuq@3.5:r32:chan")
    ap.add_argument("--contexts", default="256,2048,8192,32768")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--json", default=str(ROOT / "experiments" / "results" / "decode_step_parts.json"))
    args = ap.parse_args()
    recipe = prepare(2, DEFAULT_RECIPE)
    _, _, _, rope, scaling, q, k1, v1 = step_inputs(recipe)
    compiled = {"_attend": A._attend, "kernel_inputs": A.kernel_inputs, **{p: getattr(A, p) for p in PASSES}}
    plain = {"append": KVStore.append, "view": KVStore.view}
    rows = []
    for method in args.methods.split(","):
        for t in (int(x) for x in args.contexts.split(",")):
            _, fused, reset = decode_step(method, recipe, q, k1, v1, rope, scaling, t)  # checked

            def step(fused=fused, reset=reset):
                out = fused()
                reset()
                return out

            # the whole step and the Python around the compiled kernel
            t0 = time.perf_counter()
            A._attend, A.kernel_inputs = timed("_attend", compiled["_attend"]), timed("kernel_inputs",
                                                                                      compiled["kernel_inputs"])
            KVStore.append, KVStore.view = timed("append", plain["append"]), timed("view", plain["view"])
            try:
                calls = run(timed("step", step), args.seconds)
                parts = {k: round(statistics.median(v), 1) for k, v in TIMES.items()}
            finally:
                A._attend, A.kernel_inputs = compiled["_attend"], compiled["kernel_inputs"]
                KVStore.append, KVStore.view = plain["append"], plain["view"]
            # the compiled passes, called one by one from `_attend`'s Python version
            python_lanes()
            A._attend = compiled["_attend"].py_func
            for p in PASSES:
                setattr(A, p, timed(p, compiled[p]))
            try:
                run(step, args.seconds)
                passes = {k: round(statistics.median(v), 1) for k, v in TIMES.items() if k in PASSES}
            finally:
                for name, f in compiled.items():
                    setattr(A, name, f)
            rows.append({"method": method, "context": t, "calls": calls, "step_us": parts.pop("step"),
                         "parts_us": parts, "passes_us": passes, "seconds": round(time.perf_counter() - t0, 1)})
            print(json.dumps(rows[-1]), flush=True)
    out = {"machine": decode_machine(), "store": "benchmarks/decode.py's synthetic store, the recipe's middle layer",
           "timing": "medians over calls back to back; the passes from _attend's Python version", "rows": rows}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
