"""Where the fused decode kernel spends its time: each pass of the numba backend timed on its own.

For one context length and each method, on the same synthetic stores as
`decode.py`: the whole `decode_attention` call over the store's view (as
generate() calls it), after checking it against the reference backend on that
store; the preparation of the kernel's inputs alone (`kernel_inputs`: numpy
views, tables, checks); then each pass called alone in a loop on those inputs:
keys, key outliers, row maxima, values with the softmax, value outliers; and
dense fp32 SDPA over a cache of the same shape, in the same loops. Passes called alone keep their data warm in the
caches, so their sum is below the whole call's time. With --cold, every timed
call (SDPA's too) first finds the caches evicted, as in the interleaved rounds
of `decode.py`.

    python benchmarks/decode_passes.py [--context 32768] [--methods nuq3-1%] [--threads 2]
        [--repeats 60] [--cold] [--json benchmarks/results/decode_passes[_cold].json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy as np
import torch
import torch.nn.functional as F
from numba import njit, prange

from kvsqueeze.cache.positions import PositionLog
from kvsqueeze.kernels import Rope, decode_attention
from kvsqueeze.kernels.numba import kernel_inputs, work_ranges
from kvsqueeze.kernels.numba.keys import key_scores, row_max
from kvsqueeze.kernels.numba.sparse import key_outliers, value_outliers, value_outliers_fixed
from kvsqueeze.kernels.numba.values import value_sums
from kvsqueeze.methods import parse_method

sys.path.insert(0, str(Path(__file__).parent))
from common import DEFAULT_RECIPE, check, decode_machine, fill_store, prepare, quantizers, shape  # noqa: E402


_COLD: list[np.ndarray] = []  # --cold: a buffer larger than the last-level cache, written before each timed call


@njit(parallel=True)
def _wake(a):
    for i in prange(a.shape[0]):
        a[i] += 1.0


def _before_call() -> None:
    """With --cold: evict the caches (one write per 64-byte line of the buffer), then wake numba's threads,
    so that a timed call differs from a warm one only in where its data is, not in sleeping threads."""
    if _COLD:
        _COLD[0][::16] += 1.0
        _wake(_COLD[1])


def _median_ms(f, repeats: int) -> float:
    f()
    ts = []
    for _ in range(repeats):
        _before_call()
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return round(1e3 * statistics.median(ts), 3)


def passes(method: str, tokens: int, recipe, heads: int, kv_heads: int, head_dim: int, repeats: int) -> dict:
    h, d, hq = kv_heads, head_dim, heads
    positions = PositionLog()
    store = fill_store(*quantizers(method, recipe, h * d), tokens, h * d, d, parse_method(method).sinks, positions)
    q = torch.randn(1, hq, d)
    rope, scaling = Rope.default(d), d**-0.5
    check(q, store, rope, scaling, method, tokens)
    out = {"whole call": _median_ms(lambda: decode_attention(q, store.view(), rope, scaling, backend="numba"),
                                    repeats),
           "inputs": _median_ms(lambda: kernel_inputs(q, store.view(), rope, scaling, None), repeats)}
    x = kernel_inputs(q, store.view(), rope, scaling, None)  # what the passes of a call read
    rope_args = (x.positions, x.cos_hi, x.sin_hi, x.cos_lo, x.sin_lo, x.scaling)
    chans = (x.chan_head, x.chan_pos)
    threads = x.threads
    workers = 4 * threads
    starts = work_ranges(tokens, 1, threads)  # the dense passes' work items, as the call cuts them
    scores = np.empty((1, hq, tokens), np.float32)
    m = np.empty((1, hq), np.float32)
    partial = np.empty((1, h, starts.shape[0] - 1, hq // h, d), np.float32)
    psum = np.empty(partial.shape[:-1], np.float32)
    out["keys"] = _median_ms(lambda: key_scores(x.q, x.k_codes, x.rows, x.geo, x.shift, x.klut, x.k_bits, x.k_offs, h,
                                                *rope_args, starts, scores), repeats)
    if x.k_ptr.shape[0]:
        out["key outliers"] = _median_ms(lambda: key_outliers(
            x.q, x.k_codes, x.k_words, x.klut, x.k_bits, h, *rope_args, x.k_ptr, x.k_base, x.k_to_value, x.k_chan,
            x.k_val, x.k_under, *chans, workers, scores), repeats)
    out["row maxima"] = _median_ms(lambda: row_max(scores, x.bias, x.softcap, m), repeats)
    planar = np.empty((2, 1, tokens), np.float32)
    probs = scores.copy()
    out["values and softmax"] = _median_ms(lambda: value_sums(
        probs, m, x.v_codes, x.rows, x.geo, x.shift, x.vlut, x.v_bits, x.v_offs, h, x.scale_zero, planar, starts,
        partial, psum), repeats)
    if x.v_fixed:  # as the call runs them: 16 slots at a time in vector lanes
        lanes = np.zeros((threads, 1, hq, d, 16), np.float32)
        out["value outliers"] = _median_ms(lambda: value_outliers_fixed(
            probs, x.v_codes, x.rows, x.geo, x.shift, x.vlut, x.v_bits, h, planar, x.v_fixed, x.v_chan, x.v_val,
            x.v_under, *chans, lanes), repeats)
    elif x.v_ptr.shape[0]:
        parts = np.zeros((workers, 1, hq, d), np.float32)
        out["value outliers"] = _median_ms(lambda: value_outliers(
            probs, x.v_codes, x.geo[1, 1], x.vlut, x.v_bits, h, x.scale_zero, x.v_ptr, x.v_chan, x.v_val, x.v_under,
            *chans, parts), repeats)
    qd, k, v = q.view(1, hq, 1, d), torch.randn(1, h, tokens, d), torch.randn(1, h, tokens, d)
    out["dense fp32 SDPA"] = _median_ms(
        lambda: F.scaled_dot_product_attention(qd, k, v, scale=scaling, enable_gqa=True), repeats)
    nnz = {"key_outliers": int(x.k_chan.shape[0]), "value_outliers": int(x.v_chan.shape[0])}
    return {"method": method, "context": tokens, "median_ms": out, **nnz}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--methods", default="nuq3-1%")
    p.add_argument("--heads", type=int, help="query heads (default: the recipe's model's)")
    p.add_argument("--kv-heads", type=int, help="KV heads (default: the recipe's model's)")
    p.add_argument("--head-dim", type=int, help="head width (default: the recipe's model's)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=60)
    p.add_argument("--recipe", default=DEFAULT_RECIPE if Path(DEFAULT_RECIPE).exists() else None)
    p.add_argument("--cold", action="store_true",
                   help="evict the caches before every timed call (a 400 MB buffer written), as the interleaved "
                        "rounds of decode.py and the layers of a real decode step leave them")
    p.add_argument("--json", default=None, help="default: benchmarks/results/decode_passes[_cold].json")
    args = p.parse_args(argv)
    if args.json is None:
        args.json = str(Path(__file__).parent / "results" / f"decode_passes{'_cold' if args.cold else ''}.json")
    if args.cold:
        _COLD[:] = [np.ones(100_000_000, np.float32), np.zeros(64, np.float32)]
    recipe = prepare(args.threads, args.recipe)
    rows = []
    for method in args.methods.split(","):
        rows.append(passes(method, args.context, recipe, *shape(args, recipe), args.repeats))
        print(rows[-1])
    timing = (f"median of {args.repeats} calls, each after the caches were evicted" if args.cold
              else f"median of {args.repeats} calls in a loop")
    payload = {"rows": rows, "machine": decode_machine(), "timing": timing,
               "quantizers": f"recipe {args.recipe} (middle layer)" if recipe else "synthetic, NormalFloat levels"}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
