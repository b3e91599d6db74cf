"""How much a Fisher-weighted search of each key channel's range, or a codebook per KV head, would lower the
held-out Fisher-weighted quantization error (a probe, not a method).

    python experiments/key_probes.py [--samples 8] [--json experiments/results/key_probes.json]

On the default model: `--samples` calibration windows of 2,048 tokens (the first token of each left out, as a
sink), their keys (pre-RoPE) and values with their Fisher information gathered as `kvsqueeze calibrate` does.
The even windows fit, the odd ones are held out. Per layer, outlier fraction (0 and 1%) and width (3, 4, 5
bits), the error sum F (x - x^)^2 of three quantizers, each with its codebook fitted as the recipe fits it
(weighted k-means on the normalized elements, weights F * scale^2):

- plain: the recipe's ranges (per key channel, the calibrated quantiles; per value token, its own range);
- range search: each key channel's range narrowed symmetrically by the ratio in 1.0, 0.95, ..., 0.5 that
  minimises its Fisher-weighted error on the fitting windows, alternating three times with a codebook refit
  (values: one ratio per layer for every token's range, the only thing calibration can set for an online
  range); the outlier thresholds stay the quantiles, so the stored bits are the same;
- per-head codebooks: the plain ranges with one codebook per KV head instead of one per layer.

Both sums are reported, on the fitting windows (what the search optimises) and held out (what a user would
see). The recipe's budget at 4.58 bits (`nuq@4.58:chan`) spends its predicted error 53% on keys, 47% on
values (printed by this script from `--recipe` when given).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from kvsqueeze.numerics.affine import choose_qparams
from kvsqueeze.calibrate.collect import collect
from kvsqueeze.calibrate.kmeans import WeightedHistogram, fit_codebook
from kvsqueeze.config import CalibrationConfig
from kvsqueeze.eval.texts import calibration_windows, load_text
from kvsqueeze.integrations.loading import load_model
from kvsqueeze.numerics.outliers import calibrated_thresholds, online_thresholds, outlier_mask
from kvsqueeze.shape import kv_shape

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from common import machine  # noqa: E402

RATIOS = torch.tensor([1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5])
BITS = (3, 4, 5)
FRACTIONS = (0.0, 0.01)
ROUNDS = 3  # range search and codebook refit, alternated


def fitted_levels(x, fisher, lo, hi, inside, bits: int) -> torch.Tensor:
    """A codebook of 2**bits levels fitted to x normalized by [lo, hi] (clipped elements at the ends)."""
    scale, zero = choose_qparams(lo, hi)
    hist = WeightedHistogram(bins=CalibrationConfig().bins)
    hist.add(((x - zero) / scale).clamp(-1, 1)[inside], (fisher * scale * scale)[inside])
    return torch.tensor(fit_codebook(hist, 2**bits).centers, dtype=torch.float32)


def channel_error(x, fisher, lo, hi, levels, exact) -> torch.Tensor:
    """Per channel: sum F (x - x^)^2 with x^ the nearest level in [lo, hi]; exact (outlier) elements cost 0."""
    scale, zero = choose_qparams(lo, hi)
    idx = torch.bucketize(((x - zero) / scale).contiguous(), (levels[1:] + levels[:-1]) * 0.5)
    err = fisher * (x - (levels[idx] * scale + zero)).square()
    return (err if exact is None else err.masked_fill(exact, 0.0)).sum(0)


class Part:
    """One layer's keys or values on the fitting or held-out rows, with the ranges the recipe would use."""

    def __init__(self, x, fisher, kind: str, fraction: float, key_range=None):
        self.x, self.fisher = x, fisher
        if kind == "k":  # offline, per channel: the fitting part's quantiles, shared by the held-out part
            lo, hi = key_range if key_range is not None else calibrated_thresholds(x, fraction, dim=0)
            self.lo, self.hi = lo.reshape(1, -1), hi.reshape(1, -1)
        else:  # online, per token
            self.lo, self.hi = online_thresholds(x, fraction, dim=1)
        self.exact = outlier_mask(x, self.lo, self.hi) if fraction > 0 else None
        self.inside = ~self.exact if self.exact is not None else torch.ones_like(x, dtype=torch.bool)

    def narrowed(self, ratio: torch.Tensor):
        mid, half = (self.lo + self.hi) / 2, (self.hi - self.lo) / 2
        return mid - ratio * half, mid + ratio * half

    def bounds(self, ratio=None, channels=slice(None)):
        """[lo, hi] (narrowed by `ratio` when given) on `channels`; a per-token range covers them all."""
        lo, hi = (self.lo, self.hi) if ratio is None else self.narrowed(ratio)
        return tuple(b[:, channels] if b.shape[1] > 1 else b for b in (lo, hi))

    def error(self, levels, ratio=None, channels=slice(None)) -> torch.Tensor:
        exact = None if self.exact is None else self.exact[:, channels]
        return channel_error(self.x[:, channels], self.fisher[:, channels], *self.bounds(ratio, channels), levels,
                             exact)


def probe_layer(fit: Part, held: Part, kind: str, bits: int, head_dim: int) -> dict:
    levels = fitted_levels(fit.x, fit.fisher, fit.lo, fit.hi, fit.inside, bits)
    plain = (float(fit.error(levels).sum()), float(held.error(levels).sum()))
    ratio = torch.ones(1, fit.x.shape[1] if kind == "k" else 1)
    searched = levels
    for _ in range(ROUNDS):
        errs = torch.stack([fit.error(searched, r) for r in RATIOS])  # [R, C]
        ratio = (RATIOS[errs.argmin(0)].view(1, -1) if kind == "k" else RATIOS[errs.sum(1).argmin()].view(1, 1))
        searched = fitted_levels(fit.x, fit.fisher, *fit.bounds(ratio), fit.inside, bits)
    ranged = (float(fit.error(searched, ratio).sum()), float(held.error(searched, ratio).sum()))
    per_head = [0.0, 0.0]
    for h in range(fit.x.shape[1] // head_dim):
        cs = slice(h * head_dim, (h + 1) * head_dim)
        lv = fitted_levels(fit.x[:, cs], fit.fisher[:, cs], *fit.bounds(channels=cs), fit.inside[:, cs], bits)
        per_head[0] += float(fit.error(lv, channels=cs).sum())
        per_head[1] += float(held.error(lv, channels=cs).sum())
    return {"plain": plain, "range_search": ranged, "per_head": tuple(per_head),
            "mean_ratio": float(ratio.mean())}


def budget_split(recipe_dir: str, avg_bits: float) -> dict:
    """The key and value shares of the predicted error of `nuq@<avg_bits>:chan` on a recipe."""
    from kvsqueeze.methods import budget
    from kvsqueeze.recipe import Recipe

    recipe = Recipe.load(recipe_dir)
    alloc = budget.allocate_channels(recipe, avg_bits)
    widths = np.array(budget.CHANNEL_BITS)
    total = {"k": 0.0, "v": 0.0}
    for layer, pair in enumerate(zip(alloc.keys, alloc.values)):
        for kv, c in zip(("k", "v"), pair):
            err = recipe.channel_errors(layer, kv, c.fraction).double().numpy()
            w = np.array(c.widths) if c.widths is not None else np.full(err.shape[0], c.bits)
            total[kv] += float(err[np.arange(err.shape[0]), np.searchsorted(widths, w)].sum())
    return {"avg_bits": avg_bits, "keys": total["k"], "values": total["v"],
            "key_share": round(total["k"] / (total["k"] + total["v"]), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--samples", type=int, default=8, help="calibration windows (even: fit, odd: held out)")
    ap.add_argument("--recipe", help="also split nuq@4.58:chan's predicted error into keys and values")
    ap.add_argument("--json", default="experiments/results/key_probes.json")
    args = ap.parse_args()
    if args.samples < 2:
        raise SystemExit("--samples must be at least 2: half the windows fit, half are held out")
    t0 = time.perf_counter()
    model, tok = load_model(args.model)
    ids = calibration_windows(tok, load_text("bbc").calibration, args.samples, 2048)
    acts = collect(model, ids, sinks=1, progress=False)
    head_dim = kv_shape(model.config).head_dim
    rows_per = acts.keys[0].shape[0] // args.samples
    rows = torch.arange(rows_per * args.samples).view(args.samples, rows_per)
    fit_rows, held_rows = rows[0::2].reshape(-1), rows[1::2].reshape(-1)
    sums: dict[tuple, np.ndarray] = {}
    ratios: dict[tuple, list] = {}
    for layer in range(len(acts.keys)):
        for kind, xs, fs in (("k", acts.keys, acts.key_fisher), ("v", acts.values, acts.value_fisher)):
            x, f = xs[layer].float(), fs[layer].float()
            for fraction in FRACTIONS:
                fit = Part(x[fit_rows], f[fit_rows], kind, fraction)
                held = Part(x[held_rows], f[held_rows], kind, fraction, key_range=(fit.lo, fit.hi))
                for bits in BITS:
                    r = probe_layer(fit, held, kind, bits, head_dim)
                    key = (kind, fraction, bits)
                    sums[key] = sums.get(key, 0) + np.array([*r["plain"], *r["range_search"], *r["per_head"]])
                    ratios.setdefault(key, []).append(r["mean_ratio"])
        print(f"layer {layer} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    out = []
    for (kind, fraction, bits), s in sorted(sums.items()):
        row = {"tensor": {"k": "keys", "v": "values"}[kind], "outliers": fraction, "bits": bits,
               "plain_fit": s[0], "plain_held_out": s[1],
               "range_search_fit": s[2], "range_search_held_out": s[3],
               "per_head_fit": s[4], "per_head_held_out": s[5],
               "range_search_change_fit": round(100 * (s[2] / s[0] - 1), 2),
               "range_search_change_held_out": round(100 * (s[3] / s[1] - 1), 2),
               "per_head_change_fit": round(100 * (s[4] / s[0] - 1), 2),
               "per_head_change_held_out": round(100 * (s[5] / s[1] - 1), 2),
               "mean_ratio": round(float(np.mean(ratios[(kind, fraction, bits)])), 3)}
        out.append({k: (float(f"{v:.5g}") if isinstance(v, np.floating) else v) for k, v in row.items()})
        print({k: v for k, v in out[-1].items() if "change" in k or k in ("tensor", "outliers", "bits")})
    payload = {"model": args.model, "text": "bbc (calibration part)",
               "windows": f"{args.samples} of 2048 tokens, 1 sink; even windows fit, odd held out",
               "error": "sum over elements of Fisher * (x - x^)^2, keys pre-RoPE", "head_dim": head_dim,
               "machine": machine(), "seconds": round(time.perf_counter() - t0, 1), "rows": out}
    if args.recipe:
        payload["budget_split"] = budget_split(args.recipe, 4.58)
        print(payload["budget_split"])
    Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
