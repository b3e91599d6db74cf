"""Where the numba value pass spends its time: the code lookups and products, the word gathers, the exponentials.

`values.value_sums` runs, for each work item (a token range of one row) and each span of 256 tokens: the
per-token scales and zero-points converted from fp16, for each KV head its codes' words gathered by slot and
transposed (`common.gather_words`), each query head's softmax weights exp(score - max) * scale, and the products
of those weights with every channel's looked-up levels (`values._accumulate`), then one horizontal sum per
channel. This probe times the whole pass on `benchmarks/decode.py --step`'s store (the recipe's middle layer,
synthetic heavy-tailed keys and values), and beside it three kernels that each do one of its parts over the same
items and spans with the same helpers: the gathers alone, the exponentials and weights alone, the lookups and
products alone (over words gathered once). What the parts leave of the whole is the rest: the scales' conversion,
the horizontal sums, the work items' set-up. Variants run in turn, `--rounds` times; medians of calls in µs.

    python experiments/value_pass_parts.py [--method nuq@3.5:r32:chan] [--contexts 2048,8192,32768] [--rounds 5]
        [--json experiments/results/value_pass_parts.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy as np
import torch
from numba import njit, prange

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import DEFAULT_RECIPE, decode_machine, decode_step  # noqa: E402

from kvsqueeze.kernels.numba import attend as A  # noqa: E402
from kvsqueeze.kernels.numba.common import SPAN, TILE, V_CODES, gather_words, head_words, max_head_words  # noqa: E402
from kvsqueeze.kernels.numba.keys import key_scores, row_max  # noqa: E402
from kvsqueeze.kernels.numba.simd import LANES, vexp, vload_first, vmul, vsplat, vstore, vsub  # noqa: E402
from kvsqueeze.kernels.numba.values import _accumulate, value_sums  # noqa: E402
from kvsqueeze.numerics.rope import Rope  # noqa: E402
from kvsqueeze.recipe import Recipe  # noqa: E402


@njit(parallel=True)
def gathers_only(codes, rows, geo, shift, offs, heads, d, starts, n_rows):
    """The pass's word gathers, nothing else."""
    n_items = starts.shape[0] - 1
    max_words = max_head_words(offs, heads, d)
    for item in prange(n_rows * n_items):
        b, ck = item // n_items, item % n_items
        wb = np.empty((max_words, SPAN), np.uint32)
        for t0 in range(starts[ck], starts[ck + 1], SPAN):
            n = min(SPAN, starts[ck + 1] - t0)
            for h in range(heads):
                w0, nw = head_words(offs, h, d)
                gather_words(codes, rows, geo, V_CODES, shift, b, t0, n, w0, nw, wb, SPAN)


@njit(parallel=True)
def weights_only(scores, m, sz, heads, starts):
    """The pass's exponentials and weights (p * scale), nothing else (scores are read, not overwritten)."""
    n_rows, hq_all, n_tok = scores.shape
    g_size = hq_all // heads
    n_items = starts.shape[0] - 1
    for item in prange(n_rows * n_items):
        b, ck = item // n_items, item % n_items
        weights = np.empty((g_size, SPAN), np.float32)
        for t0 in range(starts[ck], starts[ck + 1], SPAN):
            n = min(SPAN, starts[ck + 1] - t0)
            for h in range(heads):
                for g in range(g_size):
                    row = (b * hq_all + h * g_size + g) * n_tok + t0
                    mv = vsplat(m[b, h * g_size + g])
                    for k in range(0, n, LANES):
                        p = vexp(vsub(vload_first(scores, row + k, n - k), mv))
                        vstore(weights, g * SPAN + k, vmul(p, vload_first(sz, b * n_tok + t0 + k, n - k)))


@njit(parallel=True)
def products_only(codes, rows, geo, shift, vlut, bits, offs, heads, g_size, d, starts, n_rows):
    """The pass's lookups and products over every span, its words gathered once per item (not timed apart)."""
    n_items = starts.shape[0] - 1
    max_words = max_head_words(offs, heads, d)
    for item in prange(n_rows * n_items):
        b, ck = item // n_items, item % n_items
        wb = np.empty((heads, max_words, SPAN), np.uint32)
        weights = np.full((g_size, SPAN), np.float32(1e-3), np.float32)
        acc = np.empty((heads, g_size, d, LANES), np.float32)
        first = starts[ck]
        n0 = min(SPAN, starts[ck + 1] - first)
        for h in range(heads):
            w0, nw = head_words(offs, h, d)
            gather_words(codes, rows, geo, V_CODES, shift, b, first, n0, w0, nw, wb[h], SPAN)
        for t0 in range(first, starts[ck + 1], SPAN):
            n = min(SPAN, starts[ck + 1] - t0)
            width = (n + LANES - 1) // LANES * LANES
            for h in range(heads):
                w0, _ = head_words(offs, h, d)
                for gt in range(0, g_size, TILE):
                    _accumulate(wb[h], w0, h * d, d, bits, offs, vlut, weights, gt, min(TILE, g_size - gt), width,
                                acc[h], t0 == first)


def median_us(f, calls: int) -> float:
    f()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="nuq@3.5:r32:chan")
    ap.add_argument("--contexts", default="2048,8192,32768")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--recipe", default=str(DEFAULT_RECIPE))
    ap.add_argument("--json", default="experiments/results/value_pass_parts.json")
    args = ap.parse_args()
    recipe = Recipe.load(args.recipe)
    hq, h, d = 9, 3, 64  # the default model's layer
    rope, scaling = Rope.default(d), d**-0.5
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, hq, d)
    k1, v1 = torch.randn(1, 1, h * d, generator=g), torch.randn(1, 1, h * d, generator=g)
    numba.set_parallel_chunksize(1)  # as `decode_attention` runs the passes
    rows = []
    for tokens in (int(x) for x in args.contexts.split(",")):
        store, _, _ = decode_step(args.method, recipe, q, k1, v1, rope, scaling, tokens)  # checked
        i = A.kernel_inputs(q, store.view(), rope, scaling, None)
        starts = A.work_ranges(i.positions.shape[0], 1, i.threads)
        key_scores(i.q, i.k_codes, i.rows, i.geo, i.shift, i.klut, i.k_bits, i.k_offs, i.heads, i.positions,
                   i.cos_hi, i.sin_hi, i.cos_lo, i.sin_lo, i.scaling, starts, i.scores)
        m = np.empty((1, hq), np.float32)
        row_max(i.scores, i.bias, i.softcap, m)
        scores = i.scores.copy()  # the pass overwrites its scores with the weights: each call starts from these
        items = starts.shape[0] - 1
        partial = np.empty((1, h, items, hq // h, d), np.float32)
        psum = np.empty((1, h, items, hq // h), np.float32)

        def whole():
            i.scores[:] = scores
            value_sums(i.scores, m, i.v_codes, i.rows, i.geo, i.shift, i.vlut, i.v_bits, i.v_offs, i.heads,
                       i.scale_zero, i.sz, starts, partial, psum)

        variants = {
            "score copy (subtracted from the whole pass)": lambda: i.scores.__setitem__(slice(None), scores),
            "whole pass": whole,
            "gathers": lambda: gathers_only(i.v_codes, i.rows, i.geo, i.shift, i.v_offs, i.heads, d, starts, 1),
            "exponentials and weights": lambda: weights_only(scores, m, i.sz, i.heads, starts),
            "lookups and products": lambda: products_only(i.v_codes, i.rows, i.geo, i.shift, i.vlut, i.v_bits,
                                                          i.v_offs, i.heads, hq // h, d, starts, 1),
        }
        got = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, f in variants.items():
                got[name].append(median_us(f, args.calls))
        us = {name: round(statistics.median(v), 1) for name, v in got.items()}
        whole_us = us["whole pass"] - us["score copy (subtracted from the whole pass)"]
        parts = us["gathers"] + us["exponentials and weights"] + us["lookups and products"]
        row = {"context": tokens, "method": args.method, "value_bits": int(i.v_bits), "items": items,
               "threads": int(i.threads), "median_us": us, "whole_pass_us": round(whole_us, 1),
               "rest_us": round(whole_us - parts, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"machine": decode_machine(), "load_average_start": list(os.getloadavg()), "recipe": args.recipe,
              "shape": {"query_heads": hq, "kv_heads": h, "head_dim": d, "batch": 1},
              "timing": f"median over {args.rounds} rounds of the median of {args.calls} calls, variants in turn; "
                        "other jobs may run beside it (load_average_start)", "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
