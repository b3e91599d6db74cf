"""The calibration artifact: `recipe.safetensors` (tensors) + `recipe.json` (settings), never pickle.

A recipe holds, for every layer, the offline statistics KVQuant calibrates:
per-channel key ranges (pre- and post-RoPE) and value ranges for each outlier
fraction, per-matrix outlier thresholds, and the learned nuq codebooks for
each bit width, outlier setting and fit variant. The JSON side records the
format version, the model it was calibrated on (id, shapes and a weight
fingerprint), the calibration settings, timings and k-means objectives.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

FORMAT_VERSION = 1
TENSORS_FILE = "recipe.safetensors"
META_FILE = "recipe.json"


class RecipeError(ValueError):
    """A recipe that is missing, corrupted, or does not belong to the model at hand."""


def pct_tag(fraction: float) -> str:
    """Key fragment for an outlier fraction: 0.01 -> 'p1', 0.001 -> 'p0.1', 0 -> 'p0'."""
    return f"p{fraction * 100:g}"


def range_key(layer: int, tensor: str, fraction: float) -> str:
    """Per-channel [2, C] range (lo, hi) of `tensor` in {'k_pre', 'k_post', 'v'}."""
    return f"layers.{layer}.{tensor}.range.{pct_tag(fraction)}"


def matrix_key(layer: int, tensor: str, fraction: float) -> str:
    """Per-matrix [2] outlier thresholds (lo, hi)."""
    return f"layers.{layer}.{tensor}.matrix.{pct_tag(fraction)}"


def codebook_key(layer: int, kv: str, bits: int, fraction: float, scope: str, fit: str) -> str:
    return f"layers.{layer}.codebook.{kv}.b{bits}.{pct_tag(fraction)}.{scope}.{fit}"


def channel_error_key(layer: int, kv: str, fraction: float) -> str:
    """Per-channel [C, widths] Fisher-weighted squared error of `kv` at each width of `budget.CHANNEL_BITS`."""
    return f"layers.{layer}.chanerr.{kv}.{pct_tag(fraction)}"


PROBES = 128  # first-k_proj weights the fingerprint keeps, evenly spaced over the matrix
# (the fingerprint itself is taken from the model by `kvsqueeze.integrations.fingerprint`)
PROBE_RTOL = 2.0**-7  # 4x bf16's rounding error: the same weights in fp32, bf16 or fp16 agree within it
PROBE_ATOL = 2.0**-24  # fp16's subnormal spacing


def same_weights(recipe_fp: dict, model_fp: dict) -> bool:
    """Whether two fingerprints of equal shapes come from the same weights, possibly at another precision.

    The hash tells equal weights apart exactly; a model calibrated in fp32 and served in bf16 or fp16 hashes
    otherwise, but its probed weights agree within that precision's rounding. (A recipe without probes, from
    before they were recorded, must match the hash.)
    """
    if recipe_fp.get("k_proj_sha256") == model_fp["k_proj_sha256"]:
        return True
    a, b = recipe_fp.get("k_proj_probe"), model_fp["k_proj_probe"]
    if not isinstance(a, list) or len(a) != len(b) or not all(isinstance(v, (int, float)) for v in a):
        return False  # no probes (or an edited file's): the hash alone decides
    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return bool(((x - y).abs() <= PROBE_RTOL * torch.maximum(x.abs(), y.abs()) + PROBE_ATOL).all())


@dataclass
class Recipe:
    """Offline calibration statistics for one model."""

    meta: dict
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    # ---- lookups -------------------------------------------------------------------------
    def _get(self, key: str, hint: str) -> torch.Tensor:
        if key not in self.tensors:
            s = self.meta.get("settings", {})
            raise RecipeError(
                f"recipe has no entry {key!r} ({hint}); it was calibrated with bits={s.get('bits')}, "
                f"outlier fractions={s.get('fractions')}: recalibrate with the settings this method needs"
            )
        return self.tensors[key]

    def channel_range(self, layer: int, tensor: str, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
        r = self._get(range_key(layer, tensor, fraction), f"per-channel {tensor} range")
        return r[0], r[1]

    def matrix_thresholds(self, layer: int, tensor: str, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
        r = self._get(matrix_key(layer, tensor, fraction), f"per-matrix {tensor} thresholds")
        return r[0], r[1]

    def codebook(self, layer: int, kv: str, bits: int, fraction: float, scope: str, fit: str) -> torch.Tensor:
        return self._get(codebook_key(layer, kv, bits, fraction, scope, fit), f"{bits}-bit {kv} codebook")

    def channel_errors(self, layer: int, kv: str, fraction: float) -> torch.Tensor:
        key = channel_error_key(layer, kv, fraction)
        if key not in self.tensors:
            raise RecipeError(f"recipe has no per-channel errors {key!r}, which ':chan' bit budgets read: "
                              "recalibrate it with this version of kvsqueeze (`kvsqueeze calibrate`)")
        return self.tensors[key]

    # ---- model check ---------------------------------------------------------------------
    def check_fingerprint(self, have: dict) -> None:
        """Raise RecipeError unless this recipe was calibrated on the model of fingerprint `have` (at any of fp32,
        bf16, fp16); `kvsqueeze.integrations.fingerprint.check_recipe` takes the model itself."""
        want = self.meta.get("model", {}).get("fingerprint", {})
        weights = ("k_proj_sha256", "k_proj_probe")
        diff = [f"{k}: recipe {want.get(k)} vs model {have[k]}" for k in have
                if k not in weights and want.get(k) != have[k]]
        if not diff and not same_weights(want, have):
            diff = [(f"k_proj_sha256: recipe {want.get('k_proj_sha256')} vs model {have['k_proj_sha256']}, "
                     "and its weights differ by more than a change of precision would")]
        if diff:
            raise RecipeError(
                f"recipe was calibrated on model {self.meta.get('model', {}).get('id')!r}, not on this one "
                f"({'; '.join(diff)}); run `kvsqueeze calibrate` for this model"
            )

    # ---- files ---------------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().float().cpu().contiguous() for k, v in self.tensors.items()}
        save_file(tensors, str(d / TENSORS_FILE), metadata={"format_version": str(FORMAT_VERSION)})
        meta = dict(self.meta, format_version=FORMAT_VERSION)
        meta["tensors_sha256"] = hashlib.sha256((d / TENSORS_FILE).read_bytes()).hexdigest()
        (d / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
        return d

    @classmethod
    def load(cls, directory: str | Path) -> "Recipe":
        from safetensors.torch import load_file

        d = Path(directory)
        if not (d / META_FILE).exists() or not (d / TENSORS_FILE).exists():
            raise RecipeError(
                f"{d} is not a recipe: expected {META_FILE} and {TENSORS_FILE} there "
                "(create one with `kvsqueeze calibrate --out DIR`)"
            )
        try:
            meta = json.loads((d / META_FILE).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RecipeError(f"{d / META_FILE} is corrupted ({exc}); recalibrate or restore the file") from exc
        if not isinstance(meta, dict):
            raise RecipeError(f"{d / META_FILE} does not hold a recipe (a JSON object); recalibrate or restore the file")
        version = meta.get("format_version")
        if version != FORMAT_VERSION:
            raise RecipeError(
                f"{d} has recipe format version {version!r}; this kvsqueeze reads version {FORMAT_VERSION}: recalibrate"
            )
        digest = hashlib.sha256((d / TENSORS_FILE).read_bytes()).hexdigest()
        if meta.get("tensors_sha256") != digest:
            raise RecipeError(
                f"{d / TENSORS_FILE} does not match the checksum in {META_FILE}: the file is corrupted or was "
                "replaced; recalibrate or restore both files together"
            )
        try:
            tensors = load_file(str(d / TENSORS_FILE))
        except Exception as exc:  # safetensors raises its own error types for truncated or bad headers
            raise RecipeError(f"{d / TENSORS_FILE} cannot be read ({exc}); recalibrate") from exc
        for k, v in tensors.items():
            if not torch.isfinite(v).all():
                raise RecipeError(f"recipe tensor {k!r} holds NaN/Inf; recalibrate")
        return cls(meta=meta, tensors=tensors)
