"""Bit budgets: each layer's key and value bit width and outlier fraction, chosen for an average of stored bits.

A method `nuq@B` (e.g. `nuq@3.5`) stores every layer's keys and values with the bit width (2, 3 or 4) and
outlier fraction (those the recipe was calibrated with) that minimise the summed predicted loss while the
cache holds B bits per K/V element on average, every byte counted (codes, scales and zero-points, outlier
values, indices and pointers, codebooks, the fp16 sinks).

The predicted loss of quantizing one layer's keys (or values) with one choice is its codebook's objective,
which the recipe stores: the Fisher-weighted squared error sum_i F_i (x_i - x^_i)^2 over the calibration
tokens, to second order twice the loss increase that quantization alone costs (KVQuant, Hooper et al., arXiv
2401.18079, Section 3.3; a diagonal Fisher approximation of the Hessian). Errors of different layers and
tensors add to first order, so the budget is a multiple-choice knapsack: one choice per (layer, tensor),
minimum summed loss, bits at most B. It is solved on its convex hull by a Lagrange multiplier (each unit
takes the choice minimising loss + lambda * bits; lambda found by bisection) and the bits left under the
budget are then spent greedily on the upgrade with the best loss saved per bit.

`nuq@B:chan` goes one unit finer: every channel of every layer's keys and values gets its own width from
`CHANNEL_BITS` (one outlier fraction per layer and tensor, as above), from the recipe's per-channel split of
the same Fisher-weighted objective (`calibrate.fit`: sum over tokens of F (x - x^)^2 for each channel and
width). Channels of one layer differ in sensitivity (F s^2) by orders of magnitude, so by reverse
water-filling the widths follow them. The multiple-choice knapsack is solved the same way, per channel. A layer's
keys (or values) may instead take one width for all their channels, stored as a plain method stores them (no
width table, one codebook): at a plain method's bits the budget can always afford that method, and keeps it
wherever widths per channel predict no gain.

`:kl` budgets rescale the units against each other by what `kvsqueeze budget` (or `calibrate --kl`)
measured: a unit's scale is the geometric mean, over the choices measured, of the KL divergence quantizing
that unit alone costs over its codebook's Fisher objective (`measured_scales`), and its predicted loss at any
choice is its Fisher objective times that scale. The Fisher weights rank the channels of one layer, and the
widths of one layer, well (they come from the same tokens), but their level from one layer to another is an
estimate a measurement can correct: on the default model the scales differ by a factor of 6.8 between units
(the first layer's values cost most per unit of Fisher error). One width measured per unit (3 bits, with and
without outliers: 120 runs of 512 tokens on the default model) places the units about as well as all three:
the choice it gives predicts, on the all-width scales, 0.3% more loss (`benchmarks/kl_widths.py`).

`nuq@B:rN` (any of the above with `:rN`) keeps each row's N most recent tokens in fp16 beside their codes
(the simulated path and the compressed cache read them in fp16 for the queries whose window they are in): their
bits, 2 * N * C * 16 per layer, count against B like the sinks, so the codes get what is left.

Everything here reads calibration data only (the recipe); evaluation text never shapes the choice. The
choice depends on the cached length through the per-channel and per-layer metadata, so it is made for
`TOKENS` tokens (the calibration and evaluation length); `calibrate --avg-bits` stores it in the recipe,
and a recipe without a stored choice gets the same one computed on load.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .methods import (FP16_BITS, POINTER_BITS, SCALE_ZERO_BITS, SUPPORTED_BITS, MethodError, MethodSpec,
                      topk_per_side)
from .recipe import Recipe, RecipeError, codebook_key

TOKENS = 2048  # cached tokens the choice is made for
INDEX_BITS = 16  # an outlier's channel index
CHANNEL_BITS = (1, 2, 3, 4, 5, 6)  # widths a ':chan' budget gives channels (the kernels' tables hold 64 levels)
WIDTH_BITS = 8  # a channel's width, stored once per layer with its codebooks


@dataclass(frozen=True)
class Choice:
    """How one layer stores its keys or its values."""

    bits: int  # the width of every channel; with `widths`, the widest
    fraction: float  # outliers kept exactly (per channel for keys, per token for values)
    widths: tuple[int, ...] | None = None  # ':chan' budgets: each channel's own width

    def label(self) -> str:
        bits = f"{self.mean_bits:.2f}" if self.widths is not None else f"{self.bits}"
        return bits + (f"-{100 * self.fraction:g}%" if self.fraction else "")

    @property
    def mean_bits(self) -> float:
        return float(np.mean(self.widths)) if self.widths is not None else float(self.bits)


@dataclass(frozen=True)
class Allocation:
    """The choice of every layer for keys and for values, at `avg_bits` for `tokens` cached tokens.

    predicted: the summed objective of the choice; bits: the average it stores (nominal outlier counts);
    window: the recent tokens it holds in fp16 beside their codes (counted in `bits`).
    """

    avg_bits: float
    tokens: int
    keys: tuple[Choice, ...]
    values: tuple[Choice, ...]
    predicted: float
    bits: float
    window: int = 0

    def as_dict(self) -> dict:
        def row(c: Choice) -> list:
            return [c.bits, c.fraction] + ([list(c.widths)] if c.widths is not None else [])

        return {"avg_bits": self.avg_bits, "tokens": self.tokens, "predicted": self.predicted, "bits": self.bits,
                "keys": [row(c) for c in self.keys], "values": [row(c) for c in self.values],
                **({"window": self.window} if self.window else {})}

    @classmethod
    def from_dict(cls, d: dict) -> Allocation:
        def choice(row: list) -> Choice:
            widths = tuple(int(w) for w in row[2]) if len(row) > 2 else None
            return Choice(int(row[0]), float(row[1]), widths)

        return cls(float(d["avg_bits"]), int(d["tokens"]), tuple(map(choice, d["keys"])),
                   tuple(map(choice, d["values"])), float(d["predicted"]), float(d["bits"]), int(d.get("window", 0)))

    def layer(self, i: int) -> tuple[Choice, Choice]:
        return self.keys[i], self.values[i]


def tensor_bits(kv: str, choice: Choice, tokens: int, channels: int, sinks: int,
                outliers: float | None = None, window: int = 0) -> dict[str, float]:
    """Bits one layer's keys ("k") or values ("v") hold, by the components of `methods.storage_bits`.

    Keys: codes, an fp16 scale and zero-point per channel, the codebook, outliers (fp16 value, 16-bit index)
    with a CSC pointer per token; values: the same with a scale and zero-point per token and exactly the
    per-token top-k outliers (no pointers). `outliers`: the count actually kept (default: nominal). `window`:
    the most recent tokens' fp16 copies (`:rN`), held beside their codes."""
    sinks = min(sinks, tokens)
    q = tokens - sinks
    if choice.widths is not None:  # every codebook ':chan' may use, and each channel's width
        codes, codebook = q * sum(choice.widths), FP16_BITS * sum(2**w for w in CHANNEL_BITS) + WIDTH_BITS * channels
    else:
        codes, codebook = q * channels * choice.bits, FP16_BITS * 2**choice.bits
    out = dict(codes=float(codes), scales=float(SCALE_ZERO_BITS * (channels if kv == "k" else q)),
               outlier_values=0.0, outlier_indices=0.0, pointers=0.0, sinks=float(sinks * channels * FP16_BITS),
               codebook=float(codebook), fp16_window=float(min(window, q) * channels * FP16_BITS))
    if choice.fraction > 0:
        if outliers is None:
            outliers = (choice.fraction * q * channels if kv == "k"
                        else 2 * topk_per_side(choice.fraction, channels) * q)
        out["outlier_values"] = FP16_BITS * outliers
        out["outlier_indices"] = INDEX_BITS * outliers
        if kv == "k":
            out["pointers"] = float(POINTER_BITS * (q + 1))
    out["total"] = sum(out.values())
    return out


def layer_storage_bits(spec: MethodSpec, recipe: Recipe, layer: int, tokens: int, channels: int,
                       k_outliers: float | None = None, v_outliers: float | None = None) -> dict[str, float]:
    """`methods.storage_bits` of one layer of a budgeted method (its own choice for keys and for values)."""
    k, v = layer_choices(spec, recipe, layer)
    kb = tensor_bits("k", k, tokens, channels, spec.sinks, k_outliers if k.fraction else None, spec.window)
    vb = tensor_bits("v", v, tokens, channels, spec.sinks, v_outliers if v.fraction else None, spec.window)
    out = {key: kb[key] + vb[key] for key in kb}
    out["elements"] = 2 * tokens * channels
    return out


def _sensitivities(recipe: Recipe, sinks: int) -> dict:
    """The table `kvsqueeze budget` stored in the recipe for `sinks` sinks (what ':kl' budgets read)."""
    table = recipe.meta.get("sensitivity", {}).get(sensitivity_key(sinks))
    if table is None:
        raise RecipeError(f"the recipe holds no measured sensitivities for {sinks} sink(s), which ':kl' budgets "
                          "read: run `kvsqueeze budget --model MODEL --recipe DIR` once to measure them")
    return table


def _options(recipe: Recipe, widths=None, fractions=None) -> list[Choice]:
    """The choices the recipe was calibrated with; those among `widths` and `fractions` where given."""
    settings = recipe.meta.get("settings", {})
    bits = [b for b in settings.get("bits", SUPPORTED_BITS) if b in SUPPORTED_BITS]
    return [Choice(b, float(f)) for b in sorted(bits) for f in sorted(settings.get("fractions", (0.0,)))
            if (widths is None or b in widths) and (fractions is None or float(f) in fractions)]


def _objective(recipe: Recipe, layer: int, kv: str, c: Choice) -> float:
    """The codebook's Fisher-weighted objective: the predicted loss of one unit at one choice."""
    key = codebook_key(layer, kv, c.bits, c.fraction, "vector", "fs2")
    try:
        return float(recipe.meta["kmeans_objective"][key]["nuq"])
    except KeyError:
        raise RecipeError(f"the recipe has no Fisher objective for {key}: recalibrate it with this version of "
                          "kvsqueeze (`kvsqueeze calibrate`) to use a bit budget") from None


def unit_key(layer: int, kv: str, c: Choice) -> str:
    return f"{layer}.{kv}.{c.bits}.{c.fraction:g}"


def sensitivity_key(sinks: int) -> str:
    return f"sink{sinks}"


def _fitting_multiplier(fits: Callable[[float], bool], start: float) -> float:
    """The smallest Lagrange multiplier whose choice fits the budget: 0 when the least-loss choice does, else
    grown from `start` by fours until one fits, then bisected (the cost falls as the multiplier grows)."""
    if fits(0.0):
        return 0.0
    lo, hi = 0.0, start
    while not fits(hi):
        hi *= 4
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def allocate(recipe: Recipe, avg_bits: float, sinks: int = 1, tokens: int = TOKENS,
             proxy: str = "fisher", window: int = 0) -> Allocation:
    """The choice of every layer's keys and values minimising the summed predicted loss at `avg_bits`.

    proxy: "fisher", the codebooks' Fisher-weighted objectives; "kl", the same times each unit's measured scale
    (`measured_scales`, from the KL divergences `calibrate.sensitivity.measure_sensitivity` stored in the recipe).
    window: recent tokens held in fp16 beside their codes (`:rN`); their bits count against `avg_bits`.

    Raises:
        MethodError: a budget below what the cheapest choice everywhere stores.
    """
    fp = recipe.meta["model"]["fingerprint"]
    layers, channels = int(fp["layers"]), int(fp["kv_heads"]) * int(fp["head_dim"])
    options = _options(recipe)
    scales = measured_scales(recipe, sinks) if proxy == "kl" else np.ones((layers, 2))
    units = [(layer, kv) for layer in range(layers) for kv in ("k", "v")]
    # per unit, the options that are not dominated (less loss for no more bits); cost in bits, loss
    table = []
    for layer, kv in units:
        rows = sorted(((tensor_bits(kv, c, tokens, channels, sinks, window=window)["total"],
                        scales[layer, "kv".index(kv)] * _objective(recipe, layer, kv, c), c) for c in options),
                      key=lambda r: (r[0], r[1]))
        kept = []
        for cost, loss, c in rows:
            if not kept or loss < kept[-1][1]:
                kept.append((cost, loss, c))
        table.append(kept)
    budget = avg_bits * 2 * tokens * channels * layers
    cheapest = sum(rows[0][0] for rows in table)
    if cheapest > budget:
        raise MethodError(f"nuq@{avg_bits:g}: below what this recipe can store ({cheapest / budget * avg_bits:.3f} "
                          "bits with every layer at its cheapest choice); give a larger average")

    def pick(lam: float) -> list[int]:
        return [min(range(len(rows)), key=lambda j: rows[j][1] + lam * rows[j][0]) for rows in table]

    def cost(idx: list[int]) -> float:
        return sum(rows[j][0] for rows, j in zip(table, idx))

    idx = pick(_fitting_multiplier(lambda lam: cost(pick(lam)) <= budget, start=1.0))
    spent = cost(idx)
    while True:  # spend what is left on the upgrade that saves the most loss per bit
        best = None
        for u, (rows, j) in enumerate(zip(table, idx)):
            for k in range(j + 1, len(rows)):
                extra = rows[k][0] - rows[j][0]
                if spent + extra <= budget:
                    gain = (rows[j][1] - rows[k][1]) / extra
                    if best is None or gain > best[0]:
                        best = (gain, u, k, extra)
        if best is None:
            break
        _, u, k, extra = best
        idx[u], spent = k, spent + extra
    chosen = [rows[j][2] for rows, j in zip(table, idx)]
    predicted = sum(rows[j][1] for rows, j in zip(table, idx))
    return Allocation(float(avg_bits), tokens, tuple(chosen[0::2]), tuple(chosen[1::2]), predicted,
                      spent / (2 * tokens * channels * layers), window)


def check_widths(widths, what: str) -> None:
    """Raise MethodError unless every width is one the kernels read (`CHANNEL_BITS`)."""
    bad = sorted({int(w) for w in widths} - set(CHANNEL_BITS))
    if bad:
        raise MethodError(f"{what}: channel widths {bad} are not supported; the kernels' tables read widths "
                          f"{', '.join(map(str, CHANNEL_BITS))}")


def measured_scales(recipe: Recipe, sinks: int = 1) -> np.ndarray:
    """[layers, 2] (keys, values): how much loss each unit's Fisher-weighted error costs, as measured.

    For every choice `kvsqueeze budget` measured (one tensor of one layer quantized at a time, on calibration
    text), the ratio of its KL divergence to the codebook's Fisher objective; a unit's scale is the geometric
    mean of its ratios. The Fisher weights rank the channels of one unit; these scales put the units on the
    measured scale against each other, where the Fisher estimate of one layer against another can be off."""
    layers = int(recipe.meta["model"]["fingerprint"]["layers"])
    table = _sensitivities(recipe, sinks)
    options = _options(recipe, table.get("bits"), table.get("fractions"))  # the choices measured
    if not options:
        raise RecipeError("the recipe's sensitivities measured none of its calibrated choices: measure them again "
                          "with `kvsqueeze budget`")
    scales = np.empty((layers, 2))
    for layer in range(layers):
        for i, kv in enumerate("kv"):
            pairs = []
            for c in options:
                if unit_key(layer, kv, c) not in table["kl"]:
                    raise RecipeError(f"the recipe's sensitivities lack layer {layer} {kv} {c.label()}: measure "
                                      "them again with `kvsqueeze budget`")
                pairs.append((float(table["kl"][unit_key(layer, kv, c)]), _objective(recipe, layer, kv, c)))
            ratios = [kl / fisher for kl, fisher in pairs if kl > 0 and fisher > 0 and math.isfinite(kl / fisher)]
            if not ratios:
                raise RecipeError(f"the recipe's sensitivities of layer {layer} {kv} are all zero: measure them "
                                  "again with `kvsqueeze budget` on more calibration text")
            scales[layer, i] = math.exp(float(np.mean(np.log(ratios))))
    return scales


def allocate_channels(recipe: Recipe, avg_bits: float, sinks: int = 1, tokens: int = TOKENS,
                      proxy: str = "fisher", window: int = 0) -> Allocation:
    """Each channel's width (`CHANNEL_BITS`) and each layer's key / value outlier fraction minimising the summed
    per-channel Fisher-weighted error at `avg_bits` (see the module docstring). proxy "kl": each unit's errors
    weighted by its measured scale (`measured_scales`). window: as `allocate`.

    A layer's keys (or values) may also take one width for all their channels, as a plain method stores them:
    no width table and only that width's codebook, so it costs less metadata than the same widths given one
    by one. The per-channel choice is therefore never forced below a plain method's choice at that method's
    bits, and where it predicts no gain it keeps it (an equal loss goes to the cheaper choice).

    Raises:
        MethodError: a budget below what the cheapest choice everywhere stores.
        RecipeError: a recipe without per-channel errors (calibrated before they were recorded).
    """
    fp = recipe.meta["model"]["fingerprint"]
    layers, channels = int(fp["layers"]), int(fp["kv_heads"]) * int(fp["head_dim"])
    fractions = sorted(float(f) for f in recipe.meta.get("settings", {}).get("fractions", (0.0,)))
    q = tokens - min(sinks, tokens)  # quantized tokens: a channel one bit wider costs q bits
    units = [(layer, kv) for layer in range(layers) for kv in ("k", "v")]
    rows = np.arange(len(units))
    # err [U, F, C, W]; fixed [U, F]: what a unit stores besides its codes
    err = np.stack([np.stack([recipe.channel_errors(layer, kv, f).double().numpy() for f in fractions])
                    for layer, kv in units])
    if err.shape[2] != channels or not 4 <= err.shape[3] <= len(CHANNEL_BITS):
        raise RecipeError(f"the recipe's per-channel errors have shape {err.shape[2:]}, expected "
                          f"({channels}, {len(CHANNEL_BITS)}): recalibrate it with this version of kvsqueeze")
    widths = np.array(CHANNEL_BITS[:err.shape[3]])  # a recipe from before the 5- and 6-bit codebooks: up to 4
    whole = np.isin(widths, SUPPORTED_BITS)  # [W]: widths a whole layer may take
    if not np.isfinite(err).all() or (err < 0).any():
        raise RecipeError("the recipe's per-channel errors hold NaN, Inf or negative values: recalibrate it")
    if proxy == "kl":
        err = err * measured_scales(recipe, sinks).reshape(-1)[:, None, None, None]
    fixed = np.array([[tensor_bits(kv, Choice(max(CHANNEL_BITS), f, (0,) * channels), tokens, channels, sinks,
                                   window=window)["total"] for f in fractions] for _, kv in units])
    # one width for the whole unit [U, F, W]: its loss and everything it stores (read where `whole` allows it)
    uniform_loss = err.sum(2)
    uniform_cost = np.array([[[tensor_bits(kv, Choice(int(w), f), tokens, channels, sinks, window=window)["total"]
                               for w in widths] for f in fractions] for _, kv in units])
    budget = avg_bits * 2 * tokens * channels * layers
    cheapest = float(np.minimum((fixed + q * channels * widths[0]).min(1),
                                uniform_cost[..., whole].min((1, 2))).sum())
    if cheapest > budget:
        raise MethodError(f"nuq@{avg_bits:g}:chan: below what this recipe can store ({cheapest / budget * avg_bits:.3f} "
                          f"bits with every channel at {widths[0]} bit); give a larger average")

    def pick(lam: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per unit: its fraction [U], its channels' widths [U, C] and whether it takes one width for all [U]."""
        w_idx = np.argmin(err + lam * q * widths, axis=-1)  # [U, F, C]
        per_channel = np.take_along_axis(err, w_idx[..., None], -1)[..., 0].sum(-1) + lam * (
            q * widths[w_idx].sum(-1) + fixed)  # [U, F]
        f_idx = per_channel.argmin(1)
        best = per_channel[rows, f_idx]
        flat = np.where(whole, uniform_loss + lam * uniform_cost, np.inf).reshape(len(units), -1)  # [U, F * W]
        u_idx = flat.argmin(1)
        uniform = flat[rows, u_idx] <= best * (1 + 1e-12)  # an equal loss: the cheaper, plain, choice
        u_f, u_w = np.divmod(u_idx, len(widths))
        w_idx = np.where(uniform[:, None], u_w[:, None], w_idx[rows, f_idx])
        return np.where(uniform, u_f, f_idx), w_idx, uniform

    def cost(f_idx: np.ndarray, w_idx: np.ndarray, uniform: np.ndarray) -> float:
        per_unit = np.where(uniform, uniform_cost[rows, f_idx, w_idx[:, 0]],
                            fixed[rows, f_idx] + q * widths[w_idx].sum(-1))
        return float(per_unit.sum())

    # errors are sums of F (x - x^)^2, small numbers: the multiplier search starts low
    f_idx, w_idx, uniform = pick(_fitting_multiplier(lambda lam: cost(*pick(lam)) <= budget, start=1e-12))
    chosen = err[rows, f_idx]  # [U, C, W] at each unit's fraction
    spent = cost(f_idx, w_idx, uniform)
    while spent + q <= budget:  # what is left: the one-bit upgrades that save the most (in per-channel units)
        now = np.take_along_axis(chosen, w_idx[..., None], -1)[..., 0]
        up = np.take_along_axis(chosen, np.minimum(w_idx + 1, len(widths) - 1)[..., None], -1)[..., 0]
        gain = np.where((w_idx + 1 < len(widths)) & ~uniform[:, None], now - up, -np.inf)
        u, c = np.unravel_index(int(gain.argmax()), gain.shape)
        if not gain[u, c] > 0:
            break
        w_idx[u, c] += 1
        spent += q
    predicted = float(np.take_along_axis(chosen, w_idx[..., None], -1).sum())
    picks = [Choice(int(widths[w[0]]), fractions[f]) if one else
             Choice(int(widths[w].max()), fractions[f], tuple(int(x) for x in widths[w]))
             for f, w, one in zip(f_idx, w_idx, uniform)]
    return Allocation(float(avg_bits), tokens, tuple(picks[0::2]), tuple(picks[1::2]), predicted,
                      spent / (2 * tokens * channels * layers), window)


def recipe_allocation(recipe: Recipe, avg_bits: float, sinks: int = 1, proxy: str = "fisher",
                      unit: str = "layer", window: int = 0) -> Allocation:
    """The recipe's stored choice for this budget, sink count, proxy and unit (`calibrate --avg-bits`,
    `kvsqueeze budget`), or the same computed now."""
    stored = recipe.meta.get("budgets", {}).get(budget_key(avg_bits, sinks, proxy, unit, window))
    if stored is not None:
        return Allocation.from_dict(stored)
    key = (id(recipe), float(avg_bits), sinks, proxy, unit, window)
    held = _COMPUTED.get(key)
    if held is None or held[0] is not recipe:
        alloc = (allocate_channels(recipe, avg_bits, sinks, proxy=proxy, window=window) if unit == "channel"
                 else allocate(recipe, avg_bits, sinks, proxy=proxy, window=window))
        held = _COMPUTED[key] = (recipe, alloc)
    return held[1]


_COMPUTED: dict[tuple, tuple[Recipe, Allocation]] = {}  # (recipe id, budget, sinks, proxy, unit, window) -> ...


def budget_key(avg_bits: float, sinks: int, proxy: str = "fisher", unit: str = "layer", window: int = 0) -> str:
    return (f"{avg_bits:g}" + (f":sink{sinks}" if sinks != 1 else "") + (f":r{window}" if window else "")
            + (":kl" if proxy == "kl" else "")
            + (":chan" if unit == "channel" else ""))


def layer_choices(spec: MethodSpec, recipe: Recipe, layer: int) -> tuple[Choice, Choice]:
    """The key and value choice of one layer for a budgeted method."""
    if spec.budget is None:
        return Choice(spec.k_bits, spec.outlier_fraction), Choice(spec.v_bits, spec.outlier_fraction)
    if recipe is None:
        raise RecipeError(f"method {spec.name!r} chooses each layer's bits from the recipe's Fisher objectives: "
                          "pass --recipe DIR")
    return recipe_allocation(recipe, spec.budget, spec.sinks, spec.budget_proxy, spec.budget_unit,
                             spec.window).layer(layer)


def describe(alloc: Allocation) -> str:
    """One line per layer: its key and value choice (with ':chan', the mean width and how many channels have each)."""
    width = max(2, int(math.log10(max(1, len(alloc.keys)))) + 1)

    def detail(c: Choice) -> str:
        if c.widths is None:
            return ""
        counts = np.bincount(np.array(c.widths), minlength=max(CHANNEL_BITS) + 1)
        return " (" + " ".join(f"{w}b:{counts[w]}" for w in CHANNEL_BITS) + ")"

    return "\n".join(f"layer {i:>{width}}: K {k.label():>6}{detail(k)}  V {v.label():>6}{detail(v)}"
                     for i, (k, v) in enumerate(zip(alloc.keys, alloc.values)))
