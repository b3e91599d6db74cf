"""Where the fused decode kernel spends its time: each pass of the numba backend timed on its own.

For one context length and each method, on the same synthetic stores as
`decode.py`: the whole `decode_attention_store` call (the store's buffers read
in place, as generate() calls it), the whole `decode_attention` call over
`CompressedKV.from_store` views, then each pass called alone in
a loop (its inputs prepared once): keys, key outliers, row maxima, values with
the softmax, value outliers; and dense fp32 SDPA over a cache of the same
shape, in the same loops. Passes called alone keep their data warm in the
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
import time
from pathlib import Path

import numba
import numpy as np
import torch
import torch.nn.functional as F
from decode import DEFAULT_RECIPE, fill_store, machine, prepare, quantizers
from numba import njit, prange

from kvsqueeze.cache.layer import PositionLog
from kvsqueeze.kernels import CompressedKV, Rope, decode_attention, decode_attention_store
from kvsqueeze.kernels import numba_cpu as nc
from kvsqueeze.kernels.numba_keys import key_scores, row_max
from kvsqueeze.kernels.numba_sparse import key_outliers, value_outliers, value_outliers_fixed
from kvsqueeze.kernels.numba_values import value_sums
from kvsqueeze.methods import parse_method


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
    store = fill_store(*quantizers(method, recipe, h * d), tokens, h * d, parse_method(method).sinks)
    positions = torch.arange(tokens, dtype=torch.int32).view(-1, 1)
    q = torch.randn(1, hq, d)
    rope, scaling = Rope.default(d), d**-0.5
    kv = CompressedKV.from_store(store, positions, h, d)
    log = PositionLog()  # the cache's position log, as generate() passes it
    log.write(0, positions.t())
    out = {"whole call": _median_ms(lambda: decode_attention_store(
        q, store, log, h, d, rope, scaling, backend="numba"), repeats),
        "whole call, CompressedKV views": _median_ms(lambda: decode_attention(
            q, CompressedKV.from_store(store, positions, h, d), rope, scaling, backend="numba"), repeats)}
    pos = nc._np(kv.positions)
    tab = nc._tables(rope, int(pos.max()))
    rope_args = (pos, tab.cos_hi, tab.sin_hi, tab.cos_lo, tab.sin_lo, np.float32(scaling))
    klut, vlut = nc._build_luts(kv.k_levels, kv.k_scale, kv.k_zero, kv.v_levels)  # the tables the call itself builds
    qn, sz = nc._np(q), nc._half_bits(kv.v_scale_zero)
    kc, vc = nc._np(kv.k_codes).view(np.uint32), nc._np(kv.v_codes).view(np.uint32)
    chans = nc._channel_maps(h, d)
    threads = numba.get_num_threads()
    workers = 4 * threads
    ks = vs = nc._starts(tokens, 1, threads)
    scores = np.empty((1, hq, tokens), np.float32)
    m = np.empty((1, hq), np.float32)
    partial = np.empty((1, h, vs.shape[0] - 1, hq // h, d), np.float32)
    psum = np.empty(partial.shape[:-1], np.float32)
    out["keys"] = _median_ms(lambda: key_scores(qn, kc, klut, kv.k_bits, h, *rope_args, ks, scores), repeats)
    if kv.k_outliers is not None and kv.k_outliers.nnz:
        k_sparse = nc._sparse(kv.k_outliers)
        out["key outliers"] = _median_ms(lambda: key_outliers(
            qn, kc, klut, kv.k_bits, h, *rope_args, *k_sparse, *chans, workers, scores), repeats)
    out["row maxima"] = _median_ms(lambda: row_max(scores, nc._NO_BIAS, m), repeats)
    planar = np.empty((2, 1, tokens), np.float32)
    probs = scores.copy()
    out["values and softmax"] = _median_ms(lambda: value_sums(
        probs, m, vc, vlut, kv.v_bits, h, sz, planar, vs, partial, psum), repeats)
    if kv.v_outliers is not None and kv.v_outliers.nnz:
        v_sparse = nc._sparse(kv.v_outliers)
        fixed = nc._fixed(kv.v_outliers, tokens)
        if fixed:  # as the call runs them: 16 slots at a time in vector lanes
            lanes = np.zeros((threads, 1, hq, d, 16), np.float32)
            out["value outliers"] = _median_ms(lambda: value_outliers_fixed(
                probs, vc, vlut, kv.v_bits, h, planar, fixed, *v_sparse[1:], *chans, lanes), repeats)
        else:
            parts = np.zeros((workers, 1, hq, d), np.float32)
            out["value outliers"] = _median_ms(lambda: value_outliers(
                probs, vc, vlut, kv.v_bits, h, sz, *v_sparse, *chans, parts), repeats)
    qd, k, v = q.view(1, hq, 1, d), torch.randn(1, h, tokens, d), torch.randn(1, h, tokens, d)
    out["dense fp32 SDPA"] = _median_ms(
        lambda: F.scaled_dot_product_attention(qd, k, v, scale=scaling, enable_gqa=True), repeats)
    nnz = {"key_outliers": int(kv.k_outliers.nnz) if kv.k_outliers is not None else 0,
           "value_outliers": int(kv.v_outliers.nnz) if kv.v_outliers is not None else 0}
    return {"method": method, "context": tokens, "median_ms": out, **nnz}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--methods", default="nuq3-1%")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
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
        rows.append(passes(method, args.context, recipe, args.heads, args.kv_heads, args.head_dim, args.repeats))
        print(rows[-1])
    timing = (f"median of {args.repeats} calls, each after the caches were evicted" if args.cold
              else f"median of {args.repeats} calls in a loop")
    payload = {"rows": rows, "machine": machine(), "timing": timing,
               "quantizers": f"recipe {args.recipe} (middle layer)" if recipe else "synthetic, NormalFloat levels"}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
