"""The method registry: one object per family answers every question about its methods.

A `Family` (one per name in `spec.FAMILIES`, found with `family(spec)`) says

* how it builds one layer's key and value quantizers from a recipe (`quantizers`);
* exactly what one layer of its cache stores, in bytes by component, for the tokens held (`layer_bytes`): for
  the methods the compressed cache holds, the very bytes its `MemoryReport` reports (`kvsqueeze.storage`);
  for the others, the bytes their own layout would hold (`source` says which);
* which paths can run a method (`why_not`: the simulated path, the compressed cache, the paged cache of a
  serving engine), with the reason when one cannot.

Consumers ask the registry (`build_quantizers`, `cache_bytes`, `average_bits`, `check_path`) instead of
branching on a family's name; adding a family is a class here and its tests.
"""

from __future__ import annotations

import dataclasses
import math

from .. import storage
from ..storage import Choice, Layout, Rows
from .spec import FIXED_AXES, SUPPORTED_BITS, MethodError, MethodSpec, parse_method

PATHS = ("simulated", "cache", "pages")  # what runs a method: SimulatedQuantization, CompressedCache, paged pages
TURBO_SEEDS = 1000  # rotation seeds: layer l draws keys from 2000 l, values from 2000 l + 1000
FP16_BITS, SCALE_ZERO_BITS = 16, 32


class Family:
    """What every family answers; see the module docstring."""

    name = ""
    unquantized = False  # holds keys and values as the model makes them: the baseline the others are measured against
    quantizes_in_attention = False  # keys and values quantized inside attention, not where the model makes them
    window_beside_codes = False  # an fp16 window (`:rN`) held beside the window's codes, not instead of them

    def needs_recipe(self, spec: MethodSpec) -> bool:
        return False

    def why_not(self, spec: MethodSpec, path: str) -> str | None:
        """Why `path` cannot run `spec` (None: it can)."""
        if path not in PATHS:
            raise ValueError(f"unknown path {path!r}; paths: {', '.join(PATHS)}")
        return None

    def quantizers(self, spec: MethodSpec, recipe, layer: int, channels: int, head_dim: int | None):
        raise NotImplementedError

    def layer_bytes(self, spec: MethodSpec, recipe, layer: int, channels: int, head_dim: int, rows: Rows,
                    held: int | None = None, k_outliers: int | None = None, v_outliers: int | None = None,
                    own_positions: bool = False) -> dict:
        raise NotImplementedError

    def describe(self, spec: MethodSpec) -> str:
        """One line on what `spec` stores, for tables."""
        raise NotImplementedError

    def source(self, spec: MethodSpec) -> str:
        """"cache": `layer_bytes` are the bytes the compressed cache holds; "model": what the family's layout would
        hold (no kvsqueeze cache stores it)."""
        return "cache" if self.why_not(spec, "cache") is None else "model"

    def modelled_bits(self, spec: MethodSpec, coded: int, channels: int, head_dim: int | None, k_outliers,
                      v_outliers) -> dict:
        """Bits of one row's `coded` quantized tokens beside their codes, as the family's own layout (no kvsqueeze
        cache) would store them: here an fp16 scale and zero-point per vector of each axis, and outliers with
        16-bit indices and 32-bit pointers where counts vary (`k_outliers` / `v_outliers`: the counts held, None:
        the nominal fraction)."""
        k_vectors = channels if spec.key_axis == "channel" else coded
        v_vectors = channels if spec.value_axis == "channel" else coded
        out = {"scales": float(SCALE_ZERO_BITS * (k_vectors + v_vectors))}
        if spec.outlier_fraction > 0:
            nominal = spec.outlier_fraction * coded * channels
            ko = nominal if k_outliers is None else k_outliers
            vo = nominal if v_outliers is None else v_outliers
            out["outlier_values"] = FP16_BITS * (ko + vo)
            out["outlier_indices"] = 16.0 * (ko + vo)
            fixed = [axis == "token" and spec.outlier_scope == "vector" for axis in (spec.key_axis, spec.value_axis)]
            out["pointers"] = float(32 * (coded + 1) * fixed.count(False))
        return out


class Fp16(Family):
    name = "fp16"
    unquantized = True

    def describe(self, spec):
        return "unquantized"

    def why_not(self, spec, path):
        super().why_not(spec, path)
        if path == "pages":
            return "fp16 is the engine's own cache; serve it without the kvsqueeze backend"
        return None

    def quantizers(self, spec, recipe, layer, channels, head_dim):
        return None, None

    def layer_bytes(self, spec, recipe, layer, channels, head_dim, rows, held=None, k_outliers=None,
                    v_outliers=None, own_positions=False):
        return storage.fp16_bytes(channels, rows, held)


class KVQuant(Family):
    """int / nf / nuq: KVQuant's quantizer (Hooper et al., arXiv 2401.18079) with standard or learned levels; the
    compressed cache holds its per-channel pre-RoPE keys and per-token values."""

    def describe(self, spec):
        dtype = {"int": "uniform", "nf": "NormalFloat", "nuq": "nuq"}[self.name]
        bits = f"K{spec.k_bits}V{spec.v_bits}, " if spec.k_bits != spec.v_bits else ""
        extra = f", {spec.pct_label} outliers" if spec.outlier_fraction else ""
        extra += f", {spec.sinks} sink" if spec.sinks else ""
        extra += f", {spec.key_slots} exact key elements per token (paged)" if spec.key_slots else ""
        return f"{bits}{dtype}, K per-{spec.key_axis} {spec.key_rope}-RoPE{extra}{_window_note(self, spec)}"

    def kvquant_axes(self, spec: MethodSpec) -> bool:
        return (spec.key_axis, spec.key_rope, spec.value_axis) == ("channel", "pre", "token")

    def needs_recipe(self, spec):
        # per-channel ranges and per-matrix thresholds are offline statistics
        return (spec.key_axis == "channel" or spec.value_axis == "channel"
                or (spec.outlier_fraction > 0 and spec.outlier_scope == "matrix"))

    def why_not(self, spec, path):
        super().why_not(spec, path)
        if path == "simulated":
            return None
        if spec.key_rope != "pre" or spec.key_axis != "channel":
            return f"its keys are quantized per {spec.key_axis} {spec.key_rope}-RoPE"
        if spec.value_axis != "token":
            return f"its values are quantized per {spec.value_axis}"
        if path == "pages":
            if spec.outlier_fraction and spec.outlier_scope != "vector":
                return "per-matrix outliers vary in count per token; use per-vector ones (drop ':pm')"
        return None

    def levels(self, spec, recipe, layer, kv, bits):
        from ..numerics.datatypes import standard_levels

        return standard_levels(spec.family, bits)

    def choices(self, spec: MethodSpec, recipe, layer: int) -> tuple[Choice, Choice]:
        return Choice(spec.k_bits, spec.outlier_fraction), Choice(spec.v_bits, spec.outlier_fraction)

    def layouts(self, spec: MethodSpec, recipe, layer: int) -> tuple[Layout, Layout]:
        """How the compressed cache holds this layer's keys and values."""
        k, v = self.choices(spec, recipe, layer)
        return (Layout("k", k, spec.outlier_scope, spec.key_slots if k.fraction else 0),
                Layout("v", v, spec.outlier_scope))

    def quantizers(self, spec, recipe, layer, channels, head_dim):
        from ..numerics.quantizer import VectorQuantizer
        from ..recipe import RecipeError

        if self.needs_recipe(spec) and recipe is None:
            raise RecipeError(f"method {spec.name!r} uses offline calibration statistics: pass --recipe DIR "
                              "(create one with `kvsqueeze calibrate`)")

        def one(kv: str, bits: int, axis: str, tensor: str) -> VectorQuantizer:
            common = dict(levels=self.levels(spec, recipe, layer, kv, bits), axis=axis,
                          fraction=spec.outlier_fraction, scope=spec.outlier_scope)
            if axis == "channel":
                lo, hi = _channel_range(spec, recipe, layer, tensor)
                if lo.numel() != channels:
                    raise RecipeError(f"recipe layer {layer} has {lo.numel()} {tensor} channels, the model has "
                                      f"{channels}: this recipe belongs to another model")
                return VectorQuantizer(lo=lo.float(), hi=hi.float(), slots=spec.key_slots, **common)
            if spec.outlier_fraction > 0 and spec.outlier_scope == "matrix":
                t_lo, t_hi = recipe.matrix_thresholds(layer, tensor, spec.outlier_fraction)
                return VectorQuantizer(mat_lo=float(t_lo), mat_hi=float(t_hi), **common)
            return VectorQuantizer(**common)

        k_tensor = "k_pre" if spec.key_rope == "pre" else "k_post"
        return one("k", spec.k_bits, spec.key_axis, k_tensor), one("v", spec.v_bits, spec.value_axis, "v")

    def layer_bytes(self, spec, recipe, layer, channels, head_dim, rows, held=None, k_outliers=None,
                    v_outliers=None, own_positions=False):
        if self.why_not(spec, "cache") is None:
            k, v = self.layouts(spec, recipe, layer)
            return storage.layer_bytes(k, v, channels, rows, spec.sinks, spec.window, held, k_outliers, v_outliers,
                                       own_positions)
        return _modelled(spec, channels, rows, held, k_outliers, v_outliers)


class Uniform(KVQuant):
    name = "int"


class NormalFloat(KVQuant):
    name = "nf"


class Nuq(KVQuant):
    """nuq: Fisher-weighted k-means codebooks from the recipe; a bit budget (`nuq@B`) takes each layer's key and
    value choice, and maybe a width per channel, from the recipe (`kvsqueeze.methods.budget`)."""

    name = "nuq"
    window_beside_codes = True

    def describe(self, spec):
        if spec.budget is None:
            return super().describe(spec)
        if spec.budget_unit == "channel":
            scaled = ", each layer's K / V scaled by its measured sensitivity" if spec.budget_proxy == "kl" else ""
            what = (f"each channel's K / V width (1-6 bits) and each layer's outliers from the per-channel Fisher "
                    f"errors{scaled}")
        else:
            proxy = ("the Fisher objectives scaled by measured sensitivities" if spec.budget_proxy == "kl"
                     else "the Fisher objectives")
            what = f"each layer's K / V bits and outliers from {proxy}"
        return f"bit budget {spec.budget:g} at {spec.budget_context} tokens: {what}{_window_note(self, spec)}"

    def needs_recipe(self, spec):
        return True

    def why_not(self, spec, path):
        if path == "simulated" and not self.kvquant_axes(spec):
            return ("nuq codebooks are calibrated for per-channel pre-RoPE keys and per-token values; use int/nf "
                    "for other axes")
        return super().why_not(spec, path)

    def levels(self, spec, recipe, layer, kv, bits):
        from ..numerics.datatypes import check_codebook

        cb = recipe.codebook(layer, kv, bits, spec.outlier_fraction, spec.outlier_scope, spec.fit)
        return check_codebook(cb, bits)

    def choices(self, spec, recipe, layer):
        if spec.budget is None:
            return super().choices(spec, recipe, layer)
        from .budget import layer_choices

        return layer_choices(spec, recipe, layer)

    def layouts(self, spec, recipe, layer):
        if spec.budget is None or not spec.key_slots:
            return super().layouts(spec, recipe, layer)
        k, v = super().layouts(spec, recipe, layer)
        fp = recipe.meta["model"]["fingerprint"]
        slots = budget_key_slots(spec, k.choice.fraction, int(fp["kv_heads"]) * int(fp["head_dim"]))
        return dataclasses.replace(k, slots=slots), v

    def quantizers(self, spec, recipe, layer, channels, head_dim):
        reason = self.why_not(spec, "simulated")
        if reason:
            raise MethodError(f"method {spec.name!r}: {reason}")
        if spec.budget is None:
            return super().quantizers(spec, recipe, layer, channels, head_dim)
        k, v = self.choices(spec, recipe, layer)
        plain = dict(budget=None, outlier_scope="vector")
        # a ':chan' choice is built at a supported width, then given its channels' own codebooks (up to 6 bits)
        kb, vb = (min(max(c.bits, min(SUPPORTED_BITS)), max(SUPPORTED_BITS)) for c in (k, v))
        slots = budget_key_slots(spec, k.fraction, channels)
        kq = super().quantizers(dataclasses.replace(spec, k_bits=kb, v_bits=kb, outlier_fraction=k.fraction,
                                                    key_slots=slots, **plain), recipe, layer, channels, head_dim)[0]
        vq = super().quantizers(dataclasses.replace(spec, k_bits=vb, v_bits=vb, outlier_fraction=v.fraction, **plain),
                                recipe, layer, channels, head_dim)[1]
        if k.widths is not None:
            kq = with_widths(kq, k.widths, recipe, layer, "k", channels)
        if v.widths is not None:
            vq = with_widths(vq, v.widths, recipe, layer, "v", channels)
        return kq, vq


class Grouped(Family):
    """Quantizers with fixed axes the compressed cache does not hold; their bytes are a model of their layout."""

    def why_not(self, spec, path):
        super().why_not(spec, path)
        if path == "simulated":
            return None
        return self.no_cache

    def layer_bytes(self, spec, recipe, layer, channels, head_dim, rows, held=None, k_outliers=None,
                    v_outliers=None, own_positions=False):
        return _modelled(spec, channels, rows, held, k_outliers, v_outliers, head_dim)


class Kivi(Grouped):
    name = "kivi"
    quantizes_in_attention = True
    no_cache = "kivi quantizes in groups with an fp16 window, which this cache does not store"

    def describe(self, spec):
        return f"KIVI, groups of {spec.group_size}, {spec.window} recent tokens fp16"

    def modelled_bits(self, spec, coded, channels, head_dim, k_outliers, v_outliers):
        g = spec.group_size  # keys per channel over groups of g tokens, values per token over groups of g channels
        return {"scales": SCALE_ZERO_BITS * (math.ceil(coded / g) * channels + coded * math.ceil(channels / g))}

    def quantizers(self, spec, recipe, layer, channels, head_dim):
        from ..numerics.datatypes import uniform_levels
        from ..numerics.quantizer import VectorQuantizer

        # keys are quantized inside attention (`integrations.kivi`), values per token in groups
        return None, VectorQuantizer(uniform_levels(spec.v_bits), "token", group=spec.group_size)


class Group(Grouped):
    name = "group"
    no_cache = "group quantizes each token in groups of channels, a layout this cache does not store"

    def describe(self, spec):
        return f"uniform per token, groups of {spec.group_size} channels"

    def modelled_bits(self, spec, coded, channels, head_dim, k_outliers, v_outliers):
        return {"scales": 2.0 * SCALE_ZERO_BITS * coded * math.ceil(channels / spec.group_size)}

    def quantizers(self, spec, recipe, layer, channels, head_dim):
        from ..numerics.datatypes import uniform_levels
        from ..numerics.quantizer import VectorQuantizer

        g = spec.group_size
        return (VectorQuantizer(uniform_levels(spec.k_bits), "token", group=g),
                VectorQuantizer(uniform_levels(spec.v_bits), "token", group=g))


class Turbo(Grouped):
    name = "turbo"
    no_cache = "turbo stores rotated head vectors (codes and an fp16 norm each), which this cache does not store"

    def describe(self, spec):
        split = ", the higher-RMS half of each head 1 bit wider" if spec.split else ""
        return f"TurboQuant-MSE: random rotation, sphere Lloyd-Max levels, fp16 norm per head{split}"

    def modelled_bits(self, spec, coded, channels, head_dim, k_outliers, v_outliers):
        if not head_dim or channels % head_dim:
            raise MethodError(f"method {spec.name!r}: turbo's storage needs the head dimension (one norm per head "
                              f"vector), got {head_dim}")
        parts = 2 if spec.split else 1
        return {"codes": 2.0 * coded * channels * 0.5 * spec.split,  # the outlier half's extra bit, K and V
                "scales": 2.0 * FP16_BITS * coded * (channels // head_dim) * parts}  # fp16 norms, K and V

    def quantizers(self, spec, recipe, layer, channels, head_dim):
        from ..numerics.turbo import TurboQuantizer

        if not head_dim or channels % head_dim:
            raise MethodError(f"method {spec.name!r} rotates each head vector: give the head dimension")
        return (TurboQuantizer(spec.k_bits, head_dim, seed=2 * TURBO_SEEDS * layer, split=spec.split),
                TurboQuantizer(spec.v_bits, head_dim, seed=2 * TURBO_SEEDS * layer + TURBO_SEEDS, split=spec.split))


def with_widths(q, widths: tuple[int, ...], recipe, layer: int, kv: str, channels: int):
    """`q` with a code width per channel: the recipe's codebook of each width at q's outlier fraction."""
    import torch

    from .budget import check_widths
    from ..numerics.datatypes import check_codebook
    from ..recipe import RecipeError

    if len(widths) != channels:
        raise RecipeError(f"layer {layer} {kv}: the recipe's budget gives {len(widths)} channel widths, the model "
                          f"has {channels} channels: this recipe belongs to another model")
    check_widths(widths, f"layer {layer} {kv}")
    books = {w: check_codebook(recipe.codebook(layer, kv, w, q.fraction, "vector", "fs2"), w) for w in set(widths)}
    return dataclasses.replace(q, levels=books[max(widths)], widths=torch.tensor(widths, dtype=torch.uint8),
                               codebooks=books)


def _window_note(fam: Family, spec: MethodSpec) -> str:
    if not (spec.window and fam.window_beside_codes):
        return ""
    return f", its {spec.window} most recent tokens in fp16 (counted)"


def _channel_range(spec: MethodSpec, recipe, layer: int, tensor: str):
    """A per-channel clipping range: the recipe's at the outlier fraction, or narrowed to per-matrix thresholds."""
    import torch

    if spec.outlier_fraction > 0 and spec.outlier_scope == "matrix":
        lo, hi = recipe.channel_range(layer, tensor, 0.0)
        t_lo, t_hi = recipe.matrix_thresholds(layer, tensor, spec.outlier_fraction)
        return torch.maximum(lo, t_lo), torch.minimum(hi, t_hi)
    return recipe.channel_range(layer, tensor, spec.outlier_fraction)


REGISTRY: dict[str, Family] = {f.name: f for f in (Fp16(), Uniform(), NormalFloat(), Nuq(), Kivi(), Group(), Turbo())}


def _check_slots(spec: MethodSpec, channels: int) -> None:
    if spec.key_slots and spec.key_slots > channels:
        raise MethodError(f"method {spec.name!r} keeps {spec.key_slots} exact key elements per token, more than the "
                          f"model's {channels} key channels: give ':kslotsN' with N at most {channels}")


def family(spec: MethodSpec) -> Family:
    return REGISTRY[spec.family]


def is_unquantized(name: str) -> bool:
    """Whether the method named `name` is the unquantized baseline (False for a name that is no method)."""
    try:
        return family(parse_method(name)).unquantized
    except MethodError:
        return False


def describe(spec: MethodSpec) -> str:
    """One line on what `spec` stores (for result tables)."""
    return family(spec).describe(spec)


def check_path(spec: MethodSpec, path: str, what: str = "") -> None:
    """Raise MethodError naming the reason unless `path` can run `spec`."""
    reason = family(spec).why_not(spec, path)
    if reason:
        raise MethodError(f"method {spec.name!r}{what}: {reason}")


def build_quantizers(spec: MethodSpec, recipe, layer: int, channels: int, head_dim: int | None = None):
    """Key and value quantizers of one layer (None for fp16; KIVI's keys are quantized in attention, `kivi.py`;
    turbo's are `turbo.TurboQuantizer`s, which need `head_dim`).

    Raises:
        RecipeError: the method needs offline statistics and no recipe (or the wrong one) was given.
        MethodError: a combination the family cannot do.
    """
    _check_slots(spec, channels)
    return family(spec).quantizers(spec, recipe, layer, channels, head_dim)


def needs_recipe(spec: MethodSpec) -> bool:
    return family(spec).needs_recipe(spec)


def cache_bytes(spec: MethodSpec, layers: int, channels: int, head_dim: int, rows: Rows, recipe=None,
                held: list[int | None] | None = None, outliers: list[tuple[int, int]] | None = None) -> dict:
    """Bytes a whole cache of `spec` holds, by component (`storage.COMPONENTS`).

    held: per layer, the slots a sliding-window layer keeps of each row (None: every one, a full layer);
    outliers: per layer, the (key, value) outlier counts held (default: nominal). A full layer shares the cache's
    one position log; a sliding layer keeps its own.
    """
    fam = family(spec)
    _check_slots(spec, channels)
    out = dict.fromkeys(storage.COMPONENTS, 0)
    stored = fam.why_not(spec, "cache") is None and spec.quantized
    for i in range(layers):
        h = held[i] if held is not None else None
        k_out, v_out = outliers[i] if outliers is not None else (None, None)
        comps = fam.layer_bytes(spec, recipe, i, channels, head_dim, rows, h, k_out, v_out,
                                own_positions=stored and h is not None)
        for name, n in comps.items():
            out[name] += n
    if stored and (held is None or any(h is None for h in held)):
        out["positions"] += storage.positions_bytes(rows)
    return out


def average_bits(spec: MethodSpec, layers: int, channels: int, head_dim: int, tokens: int, recipe=None,
                 batch: int = 1, windows: list | None = None) -> float:
    """Stored bits per K/V element held of `batch` unpadded rows of `tokens` tokens, every component counted;
    `windows`: each layer's sliding window (None: every token; a recipe's fingerprint names them), whose layers
    hold their last window - 1 tokens."""
    rows = Rows(tokens, (0,) * batch)
    held = storage.held_by_layer(windows, tokens) if windows is not None else None
    if held is not None and len(held) != layers:
        raise ValueError(f"average_bits: {len(held)} layer windows for {layers} layers")
    elements = 2 * batch * channels * storage.tokens_held(held, tokens, layers)
    return 8 * storage.total(cache_bytes(spec, layers, channels, head_dim, rows, recipe, held=held)) / max(elements, 1)


def budget_key_slots(spec: MethodSpec, fraction: float, channels: int) -> int:
    """A bit budget's fixed exact key elements per token in a layer keeping `fraction` of its `channels` key
    channels exact (':kslotsN'): at most N, and no more than the layer paid for (its key outliers at their
    headroom); none in a layer without key outliers. The pages and the registry's byte count both take it."""
    if not spec.key_slots or not fraction:
        return 0
    from .budget import KEY_OUTLIER_HEADROOM

    return min(spec.key_slots, math.ceil(KEY_OUTLIER_HEADROOM * fraction * channels - 1e-9))


# ---- what families without a compressed cache would store --------------------------------------------------
def _modelled(spec: MethodSpec, channels: int, rows: Rows, held: int | None, k_outliers, v_outliers,
              head_dim: int | None = None) -> dict:
    """Bytes of one layer of a method no kvsqueeze cache holds, as its own layout would store them: codes, fp16
    scales and zero-points, outliers with 16-bit indices and 32-bit pointers, fp16 sinks and windows, fp16
    codebooks. Counted for unpadded rows (`rows.batch` times one row)."""
    tokens = rows.tokens if held is None else held
    k_each = None if k_outliers is None else k_outliers / rows.batch
    v_each = None if v_outliers is None else v_outliers / rows.batch
    kept = rows.counts(spec.sinks, spec.window, held)  # a sliding layer past a row's first tokens holds no sinks
    bits = _modelled_bits(spec, tokens, channels, k_each, v_each, head_dim, kept[0] / rows.batch,
                          kept[1] / rows.batch)
    out = dict.fromkeys(storage.COMPONENTS, 0)
    for name, b in bits.items():
        out[name] = rows.batch * b / 8
    return out


def _modelled_bits(spec: MethodSpec, tokens: int, channels: int, k_outliers, v_outliers, head_dim, sinks: float,
                   window: float) -> dict:
    """Bits of one row of `tokens` held tokens, `sinks` and `window` of them in fp16 (`Rows.counts`)."""
    out = dict(codes=0.0, scales=0.0, outlier_values=0.0, outlier_indices=0.0, pointers=0.0, sinks=0.0,
               fp16_window=0.0, codebook=0.0)
    fam = family(spec)
    q = tokens - sinks - (0 if fam.window_beside_codes else window)  # tokens held as codes (nuq: the window's too)
    out["sinks"] = 2.0 * sinks * channels * FP16_BITS
    out["fp16_window"] = 2.0 * window * channels * FP16_BITS
    out["codes"] = float(q * channels * (spec.k_bits + spec.v_bits))
    for name, bits in fam.modelled_bits(spec, q, channels, head_dim, k_outliers, v_outliers).items():
        out[name] += bits
    return out


assert set(REGISTRY) == set(FIXED_AXES) | {"fp16", "int", "nf", "nuq"}
