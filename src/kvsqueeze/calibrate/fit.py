"""Fit a recipe from calibration activations: ranges, outlier thresholds and nuq codebooks.

Keys (pre- and post-RoPE) and values get per-channel ranges at every outlier
fraction (quantiles over the calibration tokens) and per-matrix thresholds for
the ablation. Codebooks are fitted per layer, for K and for V, by weighted
k-means in the normalized domain A_norm = (A - z) / s over the non-outlier
elements, with weights F * s^2 (KVQuant's "fs2"); an ablation calibration adds
codebooks weighted by F ("fisher") or 1 ("unw") and per-matrix-threshold ones.
Keys are normalized by their offline per-channel (s, z); values by the online
per-token (s, z) they will get at inference.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import numpy as np
import torch
from tqdm.auto import tqdm

from ..numerics.affine import choose_qparams
from ..methods.budget import CHANNEL_BITS
from ..config import CalibrationConfig
from ..numerics.datatypes import normal_float_levels, uniform_levels
from ..integrations.fingerprint import model_fingerprint
from ..integrations.parts import layer_rotaries
from ..numerics.outliers import calibrated_thresholds, clamp_range, online_thresholds, outlier_mask
from ..recipe import Recipe, channel_error_key, codebook_key, matrix_key, range_key
from ..shape import kv_shape
from .collect import Activations
from .channels import channel_histograms, level_errors
from .kmeans import WeightedHistogram, fit_codebook


def _weights(fit: str, fisher: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if fit == "fs2":
        return fisher * scale.square()
    if fit == "fisher":
        return fisher.expand_as(fisher)
    return torch.ones_like(fisher)


def _hist_objective(hist: WeightedHistogram, centers: np.ndarray) -> float:
    """Weighted SSE of the histogram's data under `centers` (each bin assigned whole, spread included)."""
    return float(level_errors(hist.w[None], hist.wx[None], hist.wx2[None], centers)[0])


def _normalized(x, lo, hi, fraction):
    scale, zero = choose_qparams(lo, hi)
    inside = ~outlier_mask(x, lo, hi) if fraction > 0 else torch.ones_like(x, dtype=torch.bool)
    return (x - zero) / scale, scale, inside


def fit_recipe(model, acts: Activations, cfg: CalibrationConfig, model_id: str, text_name: str,
               progress: bool = True) -> Recipe:
    """Build the recipe (see the module docstring) from collected activations."""
    shape = kv_shape(model.config)
    t0 = time.perf_counter()
    uniq = torch.unique(acts.positions)
    lookup = torch.full((int(uniq.max()) + 1,), -1, dtype=torch.long)
    lookup[uniq] = torch.arange(uniq.numel())
    index = lookup[acts.positions]
    rotaries = layer_rotaries(model, shape.head_dim)
    turns: dict[tuple, tuple | None] = {}  # (layer type, turns) -> cos, sin [N, 1, R], computed once per kind
    tensors: dict[str, torch.Tensor] = {}
    objectives: dict[str, dict] = {}
    for layer in tqdm(range(shape.layers), desc="fit", unit="layer", disable=not progress):
        k = acts.keys[layer].float()
        v = acts.values[layer].float()
        n = k.shape[0]
        rot = rotaries[layer]
        key = (rot.layer_type, rot.turns)
        if key not in turns:
            cs = rot.cos_sin(uniq.view(1, -1).to(next(model.parameters()).device))
            turns[key] = None if cs is None else tuple(c[0].float().cpu()[index][:, None] for c in cs)
        k_post = rot.apply(k.view(n, shape.kv_heads, shape.head_dim), turns[key]).reshape(n, -1)
        mats = {"k_pre": k, "k_post": k_post, "v": v}
        for p in cfg.fractions:
            for name, x in mats.items():
                tensors[range_key(layer, name, p)] = torch.stack(calibrated_thresholds(x, p, dim=0))
                if p > 0 and cfg.ablation:  # per-matrix thresholds: the ablation's ':pm' rows
                    tensors[matrix_key(layer, name, p)] = torch.stack(calibrated_thresholds(x, p, dim=None))
        fisher = {"k": acts.key_fisher[layer].float(), "v": acts.value_fisher[layer].float()}
        for kv, f in fisher.items():
            if not bool(torch.isfinite(f).all()):
                raise FloatingPointError(f"layer {layer} {kv} Fisher information holds NaN or Inf; check the model")
        for p in cfg.fractions:
            # the per-matrix scope is read only by the ablation's ':pm' rows
            for scope in ("vector", "matrix") if p > 0 and cfg.ablation else ("vector",):
                for kv, x in (("k", k), ("v", v)):
                    if kv == "k":  # offline, per channel
                        if scope == "vector":
                            lo, hi = tensors[range_key(layer, "k_pre", p)]
                        else:
                            lo0, hi0 = tensors[range_key(layer, "k_pre", 0.0)]
                            t_lo, t_hi = tensors[matrix_key(layer, "k_pre", p)]
                            lo, hi = torch.maximum(lo0, t_lo), torch.minimum(hi0, t_hi)
                        lo, hi = lo.view(1, -1), hi.view(1, -1)
                    elif scope == "vector":  # online, per token
                        lo, hi = online_thresholds(x, p, dim=1)
                    else:
                        t_lo, t_hi = tensors[matrix_key(layer, "v", p)]
                        lo, hi = clamp_range(x, t_lo, t_hi, dim=1)
                    norm, scale, inside = _normalized(x, lo, hi, p)
                    for fit in cfg.fits if scope == "vector" else ("fs2",):
                        hists = channel_histograms(norm, _weights(fit, fisher[kv], scale), inside, cfg.bins)
                        hist = hists.whole()
                        # per-channel budgets (':chan') choose among CHANNEL_BITS: their codebooks are fitted too,
                        # and each channel's error at each of them is recorded
                        per_channel = (fit, scope) == ("fs2", "vector")
                        widths = sorted(set(cfg.bits) | set(CHANNEL_BITS)) if per_channel else cfg.bits
                        for bits in widths:
                            res = fit_codebook(hist, 2**bits)
                            key = codebook_key(layer, kv, bits, p, scope, fit)
                            tensors[key] = torch.tensor(res.centers, dtype=torch.float32)
                            if fit == "fs2":
                                objectives[key] = {
                                    "nuq": res.objective,
                                    "uniform": _hist_objective(hist, uniform_levels(bits).double().numpy()),
                                }
                                if bits > 1:  # NormalFloat needs two
                                    objectives[key]["nf"] = _hist_objective(
                                        hist, normal_float_levels(bits).double().numpy())
                        if per_channel:
                            tensors[channel_error_key(layer, kv, p)] = hists.errors(
                                [tensors[codebook_key(layer, kv, b, p, scope, fit)] for b in CHANNEL_BITS])
    meta = {
        "model": {"id": model_id, "fingerprint": model_fingerprint(model)},
        "text": text_name,
        "settings": {**asdict(cfg), "bits": list(cfg.bits), "fractions": list(cfg.fractions), "fits": list(cfg.fits)},
        "calibration_loss": acts.loss,
        "timings_s": {"fisher": round(acts.seconds, 2), "fit": round(time.perf_counter() - t0, 2)},
        "kmeans_objective": objectives,
    }
    return Recipe(meta=meta, tensors=tensors)
