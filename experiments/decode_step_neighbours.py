"""The fused decode step timed right after each of the other variants of `benchmarks/decode.py --step`.

`decode.py --step` used to time its variants one call each, in a rotating order, and the fused `nuq3-1%` step at
32K measured 2.3 ms in some runs and 5-8 ms in others (docs/notes.md). This probe builds the same store and
dense caches and times the fused step right after one call of each neighbour, twelve times per neighbour:

- `dynamic-float32`: the `DynamicCache` step (`torch.cat` of the new token onto the fp32 cache, then SDPA); the
  two concatenated tensors (25 MB each at 32K) are freed as the call returns;
- `dynamic-float32 kept`: the same, its tensors kept alive until the next call;
- `dynamic-float32 then 20 ms idle`: the same, then 20 ms of sleep before the fused step;
- `static-float32`: the `StaticCache` step (SDPA over a cache allocated once);
- `nothing`: fused steps back to back.

With `--settle-ms S`, every timed fused step follows S ms of untimed fused steps after the neighbour's call
(what `decode.py --step` does now). Each row keeps the twelve times in order, and the median time of each of
the `--follow` fused steps that come after the timed one (how fast the step recovers).

    python experiments/decode_step_neighbours.py [--method nuq3-1%] [--context 32768] [--settle-ms 0,25]
        [--json experiments/results/decode_step_neighbours.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import DEFAULT_RECIPE, decode_machine, decode_step, prepare, step_inputs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="nuq3-1%")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--settle-ms", default="0,25", help="comma-separated settling times to run in turn")
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--follow", type=int, default=5, help="fused steps timed after the timed one, in order")
    ap.add_argument("--json", default=str(ROOT / "experiments" / "results" / "decode_step_neighbours.json"))
    args = ap.parse_args()
    recipe = prepare(2, DEFAULT_RECIPE)
    hq, h, d, rope, scaling, q, k1, v1 = step_inputs(recipe)
    t = args.context
    _, step, reset = decode_step(args.method, recipe, q, k1, v1, rope, scaling, t)  # checked

    def fused():
        out = step()
        reset()
        return out

    keys, values = torch.randn(1, h, t - 1, d), torch.randn(1, h, t - 1, d)
    qd, kn, vn = q.view(1, hq, 1, d), k1.view(1, h, 1, d), v1.view(1, h, 1, d)
    k_all, v_all = torch.cat([keys, torch.zeros_like(kn)], dim=-2), torch.cat([values, torch.zeros_like(vn)], dim=-2)
    kept = []

    def dynamic(keep=False):
        kept.clear()
        k, v = torch.cat([keys, kn], dim=-2), torch.cat([values, vn], dim=-2)
        if keep:
            kept.append((k, v))
        return F.scaled_dot_product_attention(qd, k, v, scale=scaling, enable_gqa=True)

    neighbours = {
        "dynamic-float32": dynamic,
        "dynamic-float32 kept": lambda: dynamic(keep=True),
        "dynamic-float32 then 20 ms idle": lambda: (dynamic(), time.sleep(0.02)),
        "static-float32": lambda: F.scaled_dot_product_attention(qd, k_all, v_all, scale=scaling, enable_gqa=True),
        "nothing": lambda: None,
    }
    for _ in range(3):
        fused()
    rows = []
    for settle in (float(s) for s in args.settle_ms.split(",")):
        for name, call in neighbours.items():
            times = []
            for _ in range(args.calls):
                call()
                until = time.perf_counter() + settle / 1e3
                while time.perf_counter() < until:
                    fused()
                seq = []
                for _ in range(1 + args.follow):
                    t0 = time.perf_counter()
                    fused()
                    seq.append(1e3 * (time.perf_counter() - t0))
                times.append(seq)
            first = [round(x[0], 3) for x in times]
            rows.append({"settle_ms": settle, "after": name, "median_ms": round(statistics.median(first), 3),
                         "times_ms": first,
                         "median_ms_of_the_calls_after": [round(statistics.median(x[i] for x in times), 3)
                                                          for i in range(1, 1 + args.follow)]})
            print(f"settle {settle:>4g} ms  after {name:<32} median {rows[-1]['median_ms']:.2f} ms, then "
                  f"{rows[-1]['median_ms_of_the_calls_after']}", flush=True)
    out = {"machine": decode_machine(), "method": args.method, "context": t,
           "store": "benchmarks/decode.py's synthetic store, the recipe's middle layer", "rows": rows}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
