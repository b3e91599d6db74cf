"""The decode kernel over paged storage with and without an fp16 window: what the window's exact entries cost.

What the vLLM backend's decode calls: one layer's view of B sequences of T tokens in pages (`PageLayout.view`,
in place), with each row's last W tokens given exact (`with_window`, as the window pages hold them), for the
3.5-bit preset as vLLM serves it (the recipe's middle layer). Checks the numba result against the reference on
both views, then times the kernel's compiled entry (`_attend`) on the two, interleaved, and the two sink/window
passes alone. Random keys and values; blocks of 128 shuffled.

    python experiments/paged_window_passes.py [--shape 8x2048] [--window 32] [--rounds 200]
        [--json experiments/results/paged_window_passes.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import DEFAULT_RECIPE, decode_machine, prepare, quantizers, shape  # noqa: E402
from paged_decode import filled_pages  # noqa: E402

from kvsqueeze.kernels import Rope, decode_attention  # noqa: E402
from kvsqueeze.kernels.numba import kernel_inputs  # noqa: E402
from kvsqueeze.kernels.numba.attend import _attend  # noqa: E402
from kvsqueeze.kernels.numba.keys import sink_scores  # noqa: E402
from kvsqueeze.kernels.numba.values import sink_values  # noqa: E402
from kvsqueeze.methods import parse_method  # noqa: E402
from kvsqueeze.paged.layout import PageLayout  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="nuq@3.5:r32:chan:kslots2")
    ap.add_argument("--shape", default="8x2048")
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--json", default=str(ROOT / "experiments" / "results" / "paged_window_passes.json"))
    args = ap.parse_args()
    recipe = prepare(2, DEFAULT_RECIPE)
    hq, h, d = shape(argparse.Namespace(heads=None, kv_heads=None, head_dim=None), recipe)
    kq, vq = quantizers(args.method, recipe, h * d)
    layout = PageLayout(kq, vq, h * d, d, 128, sinks=parse_method(args.method).sinks)
    batch, tokens = (int(x) for x in args.shape.split("x"))
    g = torch.Generator().manual_seed(0)
    c = layout.channels
    pages, table, lens = filled_pages(layout, batch, tokens, g)  # what benchmarks/paged_decode.py times on
    q = torch.randn(batch, hq, d, generator=g)
    rope, scaling = Rope.default(d), d**-0.5
    view, mask = layout.view(pages, table, lens, in_place=True)
    wk, wv = torch.randn(batch, args.window, c, generator=g), torch.randn(batch, args.window, c, generator=g)
    windowed = layout.with_window(view, wk, wv, lens)
    for v in (view, windowed):  # the fast results against the reference, before any timing
        torch.testing.assert_close(decode_attention(q, v, rope, scaling, key_mask=mask, backend="numba"),
                                   decode_attention(q, v, rope, scaling, key_mask=mask, backend="reference"),
                                   rtol=2e-4, atol=2e-5)
    plain, win = kernel_inputs(q, view, rope, scaling, mask), kernel_inputs(q, windowed, rope, scaling, mask)
    times = {"without window": [], "with window": []}
    _attend(*plain), _attend(*win)
    for _ in range(args.rounds):
        for name, inputs in (("without window", plain), ("with window", win)):
            t0 = time.perf_counter()
            _attend(*inputs)
            times[name].append(time.perf_counter() - t0)
    scores = win.scores.copy()
    out = np.zeros((batch, hq, d), np.float32)
    passes = {"sink and window scores": lambda: sink_scores(
        win.q, win.heads, win.positions, win.cos_hi, win.sin_hi, win.cos_lo, win.sin_lo, win.scaling, win.sink_k,
        win.sink_slot, scores),
              "sink and window values": lambda: sink_values(
        scores, win.v_codes, win.rows, win.geo, win.shift, win.vlut, win.v_offs, win.heads, win.scale_zero,
        win.v_ptr, win.v_fixed, win.v_chan, win.v_val, win.sink_v, win.sink_slot, out)}
    for name, f in passes.items():
        f()
        ts = []
        for _ in range(args.rounds // 4):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        times[name] = ts
    result = {"machine": decode_machine(), "method": args.method, "recipe": DEFAULT_RECIPE, "batch": batch,
              "tokens": tokens, "window": args.window, "sinks": layout.sinks,
              "median_ms": {k: round(1e3 * statistics.median(v), 3) for k, v in times.items()},
              "timing": f"medians; the two views interleaved over {args.rounds} rounds, the passes alone"}
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["median_ms"]))


if __name__ == "__main__":
    main()
