"""The numba key pass alone over one layer's store, for a method and context: how fast its codes are read.

    python experiments/key_pass.py --label NAME [--context 32768] [--method q3.5] [--recipe out/recipe]
        [--repeats 400] [--json experiments/results/key_pass.json]

A synthetic store of `--context` tokens (`benchmarks/common.fill_store`, the recipe's middle layer, the shape of its
model), checked against the reference backend, then `keys.key_scores` called `--repeats` times in a row: median and
minimum milliseconds. A preset resolves for the context and the recipe's model. The run is appended to the JSON
under `--label` with the commit, the instruction set the kernels were compiled for (run it with
`kvsqueeze.kernels.numba.simd.AVX2_ENV` set to time the AVX2 path on an AVX-512 machine) and how many of the key
channels have codes of each width, so that two versions of the kernel can be timed one after the other.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from common import check, fill_store, machine, quantizers  # noqa: E402

from kvsqueeze.cache.positions import PositionLog  # noqa: E402
from kvsqueeze.kernels import Rope  # noqa: E402
from kvsqueeze.kernels.numba import simd  # noqa: E402
from kvsqueeze.kernels.numba.attend import kernel_inputs, work_ranges  # noqa: E402
from kvsqueeze.kernels.numba.keys import key_scores  # noqa: E402
from kvsqueeze.methods import preset_for  # noqa: E402
from kvsqueeze.methods.budget import recipe_windows  # noqa: E402
from kvsqueeze.recipe import Recipe  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", required=True, help="what this run times (e.g. the kernel version)")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--method", default="q3.5")
    ap.add_argument("--recipe", default="out/recipe")
    ap.add_argument("--repeats", type=int, default=400)
    ap.add_argument("--json", default="experiments/results/key_pass.json")
    args = ap.parse_args(argv)
    recipe = Recipe.load(args.recipe)
    spec = preset_for(args.method, args.context, recipe_windows(recipe))
    fp = recipe.meta["model"]["fingerprint"]
    h, d = int(fp["kv_heads"]), int(fp["head_dim"])
    hq = int(fp.get("heads") or h)
    kq, vq = quantizers(spec.name, recipe, h * d)
    store = fill_store(kq, vq, args.context, h * d, d, spec.sinks, PositionLog())
    q = torch.randn(1, hq, d, generator=torch.Generator().manual_seed(0))
    rope, scaling = Rope.default(d), d**-0.5
    check(q, store, rope, scaling, spec.name, args.context)  # the whole call equals the reference first
    x = kernel_inputs(q, store.view(), rope, scaling, None)
    starts = work_ranges(args.context, 1, x.threads)
    scores = np.empty((1, hq, args.context), np.float32)

    def keys():
        key_scores(x.q, x.k_codes, x.rows, x.geo, x.shift, x.klut, x.k_bits, x.k_offs, h, x.positions, x.cos_hi,
                   x.sin_hi, x.cos_lo, x.sin_lo, x.scaling, starts, scores)

    keys()
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        keys()
        times.append(time.perf_counter() - t0)
    widths = kq.widths if kq.widths is not None else torch.full((h * d,), spec.k_bits)
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "src"], capture_output=True, text=True).stdout.strip()
    row = {"label": args.label, "method": spec.name, "context": args.context, "isa": simd.ISA,
           "median_ms": round(1e3 * statistics.median(times), 3), "min_ms": round(1e3 * min(times), 3),
           "repeats": args.repeats, "key_channels_by_width": {int(b): int((widths == b).sum())
                                                              for b in sorted(set(widths.tolist()))},
           "commit": commit + ("+" if dirty else ""), "machine": machine(), "threads": x.threads}
    out = Path(args.json)
    rows = json.loads(out.read_text())["rows"] if out.is_file() else []
    rows.append(row)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"what": "numba key pass alone (keys.key_scores), one layer, batch 1", "rows": rows},
                              indent=1) + "\n")
    print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
