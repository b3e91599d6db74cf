"""One layer's decode step with nothing else between steps: append, view and the fused kernel, timed apart.

`benchmarks/decode.py --step` times the step in rounds beside dense torch SDPA calls, as a model's layers
alternate torch's ops and the kernels; this probe times the same step (the store `decode.py` builds: synthetic
heavy-tailed keys and values, the recipe's middle layer) call after call with no torch call between, and the
kernel's compiled entry (`_attend`) alone on fixed inputs. The difference between the two is what sharing the
cores with torch's threads costs. Each part's times are given as quantiles (min, 20%, 40%, 60%, 80%).

    python experiments/decode_step_alone.py [--methods nuq3-1%,nuq@3.5:r32:chan] [--context 32768] [--calls 40]
        [--json experiments/results/decode_step_alone.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import DEFAULT_RECIPE, decode_machine, decode_step, prepare, step_inputs  # noqa: E402

from kvsqueeze.kernels import decode_attention  # noqa: E402
from kvsqueeze.kernels.numba import kernel_inputs  # noqa: E402
from kvsqueeze.kernels.numba.attend import _attend  # noqa: E402


def quantiles(xs: list[float]) -> list[float]:
    xs = sorted(xs)
    return [round(1e3 * xs[int(q * (len(xs) - 1))], 3) for q in (0, 0.2, 0.4, 0.6, 0.8)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="nuq3-1%,nuq@3.5:r32:chan")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--json", default=str(ROOT / "experiments" / "results" / "decode_step_alone.json"))
    args = ap.parse_args()
    recipe = prepare(2, DEFAULT_RECIPE)
    _, _, _, rope, scaling, q, k1, v1 = step_inputs(recipe)
    tokens = args.context
    pos = torch.full((1, 1), tokens - 1)
    rows = []
    for i, method in enumerate(args.methods.split(",")):
        store, _, _ = decode_step(method, recipe, q, k1, v1, rope, scaling, tokens, seed=i)  # checked
        parts = {"append": [], "view": [], "decode_attention": [], "whole step": []}
        for _ in range(args.calls):
            t0 = time.perf_counter()
            store.append(k1, v1, None, pos)
            t1 = time.perf_counter()
            view = store.view()
            t2 = time.perf_counter()
            decode_attention(q, view, rope, scaling, backend="numba")
            t3 = time.perf_counter()
            store.crop(tokens - 1)
            parts["append"].append(t1 - t0)
            parts["view"].append(t2 - t1)
            parts["decode_attention"].append(t3 - t2)
            parts["whole step"].append(t3 - t0)
        inputs = kernel_inputs(q, store.view(), rope, scaling, None)
        parts["_attend alone"] = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            _attend(*inputs)
            parts["_attend alone"].append(time.perf_counter() - t0)
        rows.append({"method": method, "context": tokens, "ms_quantiles": {k: quantiles(v) for k, v in parts.items()}})
        print(json.dumps(rows[-1]), flush=True)
    out = {"machine": decode_machine(), "recipe": DEFAULT_RECIPE, "calls": args.calls,
           "quantiles": "min, 20%, 40%, 60%, 80% of the calls", "rows": rows}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
