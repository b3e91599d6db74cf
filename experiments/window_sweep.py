"""How many recent tokens a bit budget should keep in fp16 (`:rN`), chosen on calibration text only.

    python experiments/window_sweep.py --recipe out/recipe [--budgets 2.5,3.49,4.58] [--sizes 0,8,16,32,64]
        [--windows 4] [--json experiments/results/window_sweep.json]

For each budget B and window size N, `nuq@B:rN:chan` (`nuq@B:chan` for N = 0) on `--windows` windows of 2,048
tokens spread over bbc's calibration part (the text the recipe was calibrated on; the evaluation part is never
read): PPL, its change against fp16 with a paired 95% interval, the mean KL divergence from fp16 and the average
stored bits. The budget pays for the window (its fp16 copies count against B), so every size of one budget stores
the same bits and the sizes compare at equal memory. The size the package's measurements use (`:r32`) is the one
with the lowest summed KL divergence over the budgets here.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from kvsqueeze.eval.perplexity import evaluate
from kvsqueeze.eval.texts import calibration_windows, load_text
from kvsqueeze.integrations.loading import load_model
from kvsqueeze.methods import parse_method
from kvsqueeze.recipe import Recipe

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from common import machine  # noqa: E402


def method(budget: str, size: int) -> str:
    return f"nuq@{budget}" + (f":r{size}" if size else "") + ":chan"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--budgets", default="2.5,3.49,4.58")
    ap.add_argument("--sizes", default="0,8,16,32,64")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--json", default="experiments/results/window_sweep.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    model, tok = load_model(args.model)
    recipe = Recipe.load(args.recipe)
    ids = calibration_windows(tok, load_text("bbc").calibration, args.windows, args.seqlen)
    budgets = [b for b in args.budgets.split(",") if b]
    sizes = [int(s) for s in args.sizes.split(",") if s]
    names = ["fp16"] + [method(b, s) for b in budgets for s in sizes]
    t0 = time.perf_counter()
    rows = evaluate(model, ids, [parse_method(n) for n in names], recipe)
    base = rows[0].ppl
    out = []
    for name, r in zip(names, rows):
        spec = parse_method(name)
        out.append({**r.as_dict(), "budget": spec.budget, "window": spec.window if spec.budget else None,
                    "change_pct": round(100 * (r.ppl / base - 1), 4)})
        print(f"{name:22s} {r.avg_bits:.3f} bits  {out[-1]['change_pct']:+.3f}%  KLD {r.kld_mean:.5f}", flush=True)
    kld = {s: sum(o["kld_mean"] for o in out if o["window"] == s) for s in sizes}
    payload = {"model": args.model, "text": "bbc (calibration part)", "seqlen": args.seqlen,
               "windows": int(ids.shape[0]), "machine": machine(), "seconds": round(time.perf_counter() - t0, 1),
               "summed_kld_by_size": {str(s): round(v, 6) for s, v in kld.items()},
               "lowest_summed_kld": min(kld, key=kld.get), "rows": out}
    Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"lowest summed KL divergence: N = {payload['lowest_summed_kld']}; wrote {args.json}")


if __name__ == "__main__":
    main()
