"""How many widths the sensitivity measurement needs: `nuq@B:kl:chan` with scales from a subset of the choices.

    python experiments/kl_widths.py --recipe out/recipe-all [--budgets 2.5,3.49,4.58]
        [--json experiments/results/kl_widths.json]

The recipe must hold sensitivities measured at every width (`kvsqueeze budget --bits 2,3,4 --outliers 1`).
For each subset of the measured choices (widths x outlier fractions), the per-unit scales
(`budget.measured_scales`) are taken from that subset alone and the per-channel budget is chosen with them;
each choice is then scored by the loss it predicts on the scales of the whole measurement (the best estimate
at hand). The row `none` is `nuq@B:chan`, every scale 1. No model runs: the recipe's tables only.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import numpy as np

from kvsqueeze.methods.budget import CHANNEL_BITS, allocate_channels, measured_scales, sensitivity_key
from kvsqueeze.recipe import Recipe

SUBSETS = [  # (widths, outlier fractions) measured
    ((2, 3, 4), (0.0, 0.01)),
    ((3,), (0.0, 0.01)),
    ((3,), (0.01,)),
    ((3,), (0.0,)),
    ((2,), (0.0, 0.01)),
    ((4,), (0.0, 0.01)),
    ((2, 4), (0.0, 0.01)),
]


def restricted(recipe: Recipe, widths, fractions, sinks: int = 1) -> Recipe:
    """A copy of `recipe` whose sensitivity table keeps only the given widths and fractions."""
    out = copy.copy(recipe)
    out.meta = copy.deepcopy(recipe.meta)
    table = out.meta["sensitivity"][sensitivity_key(sinks)]
    table["kl"] = {k: v for k, v in table["kl"].items()
                   if int(k.split(".", 3)[2]) in widths and float(k.split(".", 3)[3]) in fractions}
    table["bits"], table["fractions"] = sorted(widths), sorted(fractions)
    return out


def scored_loss(recipe: Recipe, alloc, scales: np.ndarray) -> float:
    """The summed per-channel Fisher errors of `alloc`, each unit's weighted by `scales` [layers, 2]."""
    total = 0.0
    for layer, (k, v) in enumerate(zip(alloc.keys, alloc.values)):
        for i, (kv, c) in enumerate((("k", k), ("v", v))):
            err = recipe.channel_errors(layer, kv, c.fraction).double().numpy()
            widths = c.widths if c.widths is not None else (c.bits,) * err.shape[0]
            total += scales[layer, i] * float(sum(err[j, CHANNEL_BITS.index(w)] for j, w in enumerate(widths)))
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", required=True, help="a recipe with sensitivities measured at widths 2, 3 and 4")
    ap.add_argument("--budgets", default="2.5,3.49,4.58")
    ap.add_argument("--json", default="experiments/results/kl_widths.json")
    args = ap.parse_args()

    recipe = Recipe.load(args.recipe)
    table = recipe.meta.get("sensitivity", {}).get(sensitivity_key(1), {})
    if sorted(table.get("bits", (2, 3, 4))) != [2, 3, 4] or not {0.0, 0.01} <= set(table.get("fractions", ())):
        raise SystemExit(f"{args.recipe}: measure every width first (`kvsqueeze budget --recipe {args.recipe} "
                         "--bits 2,3,4 --outliers 1`)")
    budgets = [float(b) for b in args.budgets.split(",")]
    t0 = time.perf_counter()
    full = measured_scales(recipe)
    best = {b: scored_loss(recipe, allocate_channels(recipe, b, proxy="kl"), full) for b in budgets}
    rows = [{"measured": "none (nuq@B:chan)", "runs_per_unit": 0,
             "loss_vs_all": [scored_loss(recipe, allocate_channels(recipe, b), full) / best[b] for b in budgets]}]
    for widths, fractions in SUBSETS:
        sub = restricted(recipe, widths, fractions)
        scales = measured_scales(sub)
        ratio = scales / full
        rows.append({
            "measured": f"{','.join(map(str, widths))} bits, outliers {','.join(f'{100 * f:g}%' for f in fractions)}",
            "runs_per_unit": len(widths) * len(fractions),
            "scale_spread_vs_all": [float(ratio.min() / np.exp(np.log(ratio).mean())),
                                    float(ratio.max() / np.exp(np.log(ratio).mean()))],
            "loss_vs_all": [scored_loss(recipe, allocate_channels(sub, b, proxy="kl"), full) / best[b]
                            for b in budgets],
        })
    payload = {"recipe": args.recipe, "measurement": {k: v for k, v in table.items() if k != "kl"},
               "budgets": budgets, "seconds": round(time.perf_counter() - t0, 1), "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    print("| measured | runs per unit | " + " | ".join(f"loss at {b:g} bits" for b in budgets) + " |")
    for r in rows:
        print(f"| {r['measured']} | {r['runs_per_unit']} | " + " | ".join(f"{x:.3f}x" for x in r["loss_vs_all"]) + " |")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
