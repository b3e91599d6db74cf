"""A recipe whose calibration windows weigh the same: each window's Fisher weights scaled to the mean total.

Every fit of `calibrate` weighs each key and value element by its Fisher information, and the windows of a
calibration text do not carry equal totals: on Gemma-3-270M's mix one `facts` window holds most of the weight of
the first layers (`experiments/results/fisher_shares.json`), so those layers' codebooks and the budget's
objectives are fitted mostly to that one window. This calibrates as `kvsqueeze calibrate` does (the same windows,
settings and fits, `calibrate.fit.fit_recipe`), except that after the collection each window's key and value
Fisher weights, over all layers together, are scaled to the mean total of the windows: the relative weight of
layers, channels and tokens inside a window is kept, the windows' totals are made equal. The recipe is written
to `--out` (its settings name the scaling, `fisher_per_window: "equal"`), for `transfer_parts.py --extra` to
score beside the plain recipes.

    python experiments/balanced_fisher.py [--model gemma3-270m] [--text mix] \
        [--out out/transfer-balanced/gemma3-270m/mix]
"""

from __future__ import annotations

import argparse
import time

from kvsqueeze.calibrate.collect import collect
from kvsqueeze.calibrate.fit import fit_recipe
from kvsqueeze.config import CalibrationConfig
from kvsqueeze.eval.texts import calibration_windows, load_text


def balance(acts, windows: int) -> list[float]:
    """Scale each window's rows of every layer's key and value Fisher weights so that the window's total (all
    layers, keys and values) is the mean of the windows' totals; the factors applied."""
    rows = acts.key_fisher[0].shape[0] // windows
    totals = []
    for j in range(windows):
        part = slice(j * rows, (j + 1) * rows)
        totals.append(sum(float(f[part].float().sum()) for f in (*acts.key_fisher, *acts.value_fisher)))
    mean = sum(totals) / windows
    factors = [mean / t for t in totals]
    for j, s in enumerate(factors):
        part = slice(j * rows, (j + 1) * rows)
        for f in (*acts.key_fisher, *acts.value_fisher):
            f[part] = (f[part].float() * s).to(f.dtype)
    return factors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--text", default="mix")
    ap.add_argument("--out", default="out/transfer-balanced/gemma3-270m/mix")
    args = ap.parse_args()

    from kvsqueeze.integrations.loading import load_model

    t0 = time.perf_counter()
    cfg = CalibrationConfig()
    text = load_text(args.text)
    model, tok = load_model(args.model)
    samples = calibration_windows(tok, text, cfg.samples, cfg.seqlen)
    acts = collect(model, samples, sinks=cfg.sinks)
    factors = balance(acts, cfg.samples)
    print("window factors:", [round(f, 3) for f in factors], flush=True)
    recipe = fit_recipe(model, acts, cfg, args.model, text.name)
    recipe.meta["settings"]["fisher_per_window"] = "equal"
    recipe.meta["fisher_window_factors"] = [round(f, 5) for f in factors]
    recipe.meta["calibration_pieces"] = sorted(text.calibration_pieces)
    recipe.meta["timings_s"]["total"] = round(time.perf_counter() - t0, 2)
    print(f"recipe written to {recipe.save(args.out)} in {recipe.meta['timings_s']['total']:.1f}s", flush=True)


if __name__ == "__main__":
    main()
