"""Where a windowed prefill chunk's attention spends its time, and what bf16 dot products would buy.

A chunk of Q queries over T keys with a W-token fp16 window (`kernels.mixed._mixed_by_parts`, what the vLLM
backend's prefill and the HF path's run) is three attentions merged by their log-sum-exps: every query over
the quantized keys older than the first query's window (no mask), a causal block, and the window's band. This
probe times each part alone in float32 and bfloat16 (torch's CPU flash attention), and the score product
alone (`torch.bmm`) in both dtypes: how much a kernel with bf16 dot products could gain on a CPU that has them
(AVX512-BF16, AMX). The default shape is the default model's layer (9 query heads over 3 KV heads of 64) for
the last 256-token chunk of a 2,048-token prompt.

    python experiments/prefill_attention_parts.py [--queries 256] [--keys 2048] [--window 32] [--rounds 20]
        [--json experiments/results/prefill_attention_parts.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kvsqueeze.kernels import mixed

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from common import machine, median_ms  # noqa: E402


def timed(fn, rounds: int) -> float:
    return median_ms(fn, rounds, digits=3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queries", type=int, default=256)
    ap.add_argument("--keys", type=int, default=2048)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json", default="experiments/results/prefill_attention_parts.json")
    args = ap.parse_args()
    nq, t, w, hq, h, d = args.queries, args.keys, args.window, args.heads, args.kv_heads, args.head_dim
    g = torch.Generator().manual_seed(0)
    p0 = t - nq
    c = p0 - w  # the last quantized key every query reads
    rows = {}
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(1, hq, nq, d, generator=g).to(dtype)
        k, v = (torch.randn(1, h, t, d, generator=g).to(dtype) for _ in range(2))
        start = p0 - w + 1
        ek, ev = k[:, :, start:], v[:, :, start:]
        want = mixed.mixed_attention(q.double(), ek.double(), ev.double(), k.double(), v.double(), None, d**-0.5, w,
                                     chunk=64, start=start)[0]
        got = mixed.mixed_attention(q, ek, ev, k, v, None, d**-0.5, w, start=start)[0]
        err = float((got.double() - want).abs().max())  # the timed path against the masked-SDPA path first
        kr, vr = k.repeat_interleave(hq // h, 1), v.repeat_interleave(hq // h, 1)
        rows[str(dtype).split(".")[1]] = {
            "max_abs_error_vs_float64_reference": err,
            "whole_ms": timed(lambda: mixed.mixed_attention(q, ek, ev, k, v, None, d**-0.5, w, start=start),
                              args.rounds),
            "older_keys_part_ms": timed(lambda: mixed._part(q, k[:, :, :c + 1], v[:, :, :c + 1], d**-0.5, False),
                                        args.rounds),
            "causal_block_ms": timed(lambda: mixed._part(q, k[:, :, c + 1:c + 1 + nq], v[:, :, c + 1:c + 1 + nq],
                                                         d**-0.5, True), args.rounds),
            "scores_bmm_ms": timed(lambda: torch.bmm(q[0], kr[0].transpose(1, 2)), args.rounds),
        }
    flops = 4 * hq * nq * (c + 1) * d  # the older keys' part: scores and weighted values
    result = {"machine": machine(), "threads": torch.get_num_threads(), "queries": nq, "keys": t, "window": w,
              "heads": hq, "kv_heads": h, "head_dim": d, "rounds": args.rounds, "timing": "median wall ms",
              "older_keys_part_gflops": {k: round(flops / (r["older_keys_part_ms"] * 1e6), 1)
                                         for k, r in rows.items()},
              **rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
