"""Bit budgets: each layer's key and value bit width and outlier fraction, chosen for an average of stored bits.

A method `nuq@B` (e.g. `nuq@3.5`) stores every layer's keys and values with the bit width (2, 3 or 4) and
outlier fraction (those the recipe was calibrated with) that minimise the summed predicted loss while the
cache holds B bits per K/V element on average at the context it is chosen for, every byte the compressed cache
holds counted as `kvsqueeze.storage` counts it (codes in whole int32 words, scales and zero-points, outlier
values, indices and pointers, codebooks and decode tables, the fp16 sinks and window, the slot tables and
positions).

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
the choice it gives predicts, on the all-width scales, 0.3% more loss (`experiments/kl_widths.py`).

`nuq@B:rN` (any of the above with `:rN`) keeps each row's N most recent tokens in fp16 beside their codes
(the simulated path and the compressed cache read them in fp16 for the queries whose window they are in): their
bits, 2 * N * C * 16 per layer, count against B like the sinks, so the codes get what is left.

Everything here reads calibration data only (the recipe); evaluation text never shapes the choice. The
choice depends on the cached length through the per-channel and per-layer metadata and the window, so it is
made for one context: `methods.spec.DEFAULT_CONTEXT` tokens (the calibration and evaluation length) or the
one the method names (`:ctxN`); `calibrate --avg-bits` stores it in the recipe, and a recipe without a stored
choice gets the same one computed on load.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .. import storage
from ..recipe import Recipe, RecipeError, codebook_key
from ..storage import Choice, Layout, Rows
from .spec import DEFAULT_CONTEXT, SUPPORTED_BITS, MethodError, MethodSpec, context_flag

CHANNEL_BITS = (1, 2, 3, 4, 5, 6)  # widths a ':chan' budget gives channels (the kernels' tables hold 64 levels)
CAPS = (4, 5, 6)  # the widest width a ':chan' unit may use: its decode table holds 2**cap levels per channel

__all__ = ["Choice", "Allocation", "allocate", "allocate_channels", "recipe_allocation", "layer_choices",
           "unit_bits", "shared_bits", "held_tokens", "held_sinks", "sliding_layers", "recipe_windows", "budget_key",
           "describe", "measured_scales", "check_widths", "CHANNEL_BITS"]


@dataclass(frozen=True)
class Allocation:
    """The choice of every layer for keys and for values, at `avg_bits` for `tokens` cached tokens.

    predicted: the summed objective of the choice; bits: the average it is charged at `tokens` tokens, every
    component of `kvsqueeze.storage` counted, the key outliers at `KEY_OUTLIER_HEADROOM` times their nominal count
    (an upper bound on what the cache holds on text like the calibration text; the memory planner and
    `methods.average_bits` count them at their nominal count); window: the recent tokens it holds in fp16 beside
    their codes (counted in `bits`).
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
                **({"window": self.window} if self.window else {}), "storage": STORAGE_VERSION}

    @classmethod
    def from_dict(cls, d: dict) -> Allocation:
        def choice(row: list) -> Choice:
            widths = tuple(int(w) for w in row[2]) if len(row) > 2 else None
            return Choice(int(row[0]), float(row[1]), widths)

        return cls(float(d["avg_bits"]), int(d["tokens"]), tuple(map(choice, d["keys"])),
                   tuple(map(choice, d["values"])), float(d["predicted"]), float(d["bits"]), int(d.get("window", 0)))

    def layer(self, i: int) -> tuple[Choice, Choice]:
        return self.keys[i], self.values[i]


# Keys keep the elements beyond per-channel thresholds fitted on the calibration tokens, so on other tokens they
# keep a little more than their fraction: 1.09x on the default model's BBC evaluation windows at 2,048 tokens and
# 1.10x at 32K (`benchmarks/results/memory.json`, the memory report against the nominal count). A budget charges
# its keys this much more, so that the bits in its name hold in the cache on text like its calibration text.
KEY_OUTLIER_HEADROOM = 1.2


def unit_bits(kv: str, choice: Choice, tokens: int, channels: int, sinks: int) -> float:
    """Bits one layer's keys ("k") or values ("v") hold in the compressed cache when it holds `tokens` tokens of
    one row, `sinks` of them sinks (a sliding layer: its window's, `held_tokens`, `held_sinks`):
    `storage.tensor_bytes`, the count the cache's memory report equals, the sink slots' share included, with the
    keys' outliers at `KEY_OUTLIER_HEADROOM` times their nominal count."""
    n_sinks = min(sinks, tokens)
    layout = Layout(kv, choice)
    held = None
    if kv == "k" and choice.fraction > 0:
        held = math.ceil(KEY_OUTLIER_HEADROOM * storage.nominal_outliers(layout, channels, tokens - n_sinks))
    return 8.0 * storage.total(storage.tensor_bytes(layout, channels, tokens, n_sinks, held))


def recipe_windows(recipe: Recipe) -> list[int | None]:
    """Each layer's sliding window from the recipe's fingerprint (a recipe without them: every layer full)."""
    fp = recipe.meta["model"]["fingerprint"]
    return fp.get("layer_windows") or [None] * int(fp["layers"])


def held_tokens(recipe: Recipe, tokens: int) -> list[int]:
    """Tokens each layer holds of a row of `tokens` (one row): all of them, or on a sliding-window layer the last
    window - 1, as the compressed cache keeps them (`storage.held_by_layer`)."""
    return [tokens if h is None else h for h in storage.held_by_layer(recipe_windows(recipe), tokens)]


def held_sinks(held: list[int], sinks: int, tokens: int) -> list[int]:
    """Sink tokens each layer still holds of a row of `tokens` (`held`: each layer's tokens, `held_tokens`): a
    sliding layer that moved past a row's first tokens holds none of them."""
    rows = Rows(tokens)
    return [rows.counts(sinks, 0, h)[0] for h in held]


def sliding_layers(recipe: Recipe) -> list[bool]:
    """Which layers slide (keep their own positions and drop old tokens), from the recipe's `layer_windows`."""
    return [w is not None for w in recipe_windows(recipe)]


def shared_bits(held: list[int], channels: int, sinks: int, window: int, tokens: int,
                sliding: list[bool] | None = None) -> float:
    """Bits every choice pays alike in a cache of `tokens` tokens (one row; the row's length, not what a layer
    holds: on a sliding layer its sinks are gone once the row is longer than the layer's window):
    each layer's fp16 sinks and window and its table of their slots, the full layers' shared position log and
    each sliding layer's own (`held`: the tokens each layer holds, `held_tokens`; `sliding`: which layers slide,
    `sliding_layers`), as `storage.cache_bytes` counts them."""
    sliding = sliding or [False] * len(held)
    rows = Rows(tokens)
    out = 0
    for h, slides in zip(held, sliding):
        n_sinks, n_window = rows.counts(sinks, window, h)
        out += 2 * storage.FP16_BYTES * (n_sinks + n_window) * channels + 4 * (sinks + window)
        if slides:
            out += 4 * h  # a sliding layer's own positions
    if not all(sliding):
        out += storage.positions_bytes(rows)
    return 8.0 * out


@dataclass(frozen=True)
class _Holding:
    """What each layer of a cache of `tokens` tokens holds of a row: tokens, sinks, and whether it slides."""

    tokens: int
    held: list[int]
    kept: list[int]
    sliding: list[bool]

    @classmethod
    def of(cls, recipe: Recipe, tokens: int, sinks: int) -> _Holding:
        held = held_tokens(recipe, tokens)
        return cls(tokens, held, held_sinks(held, sinks, tokens), sliding_layers(recipe))

    def shared(self, channels: int, sinks: int, window: int) -> float:
        return shared_bits(self.held, channels, sinks, window, self.tokens, self.sliding)

    def elements(self, channels: int) -> int:
        return 2 * sum(self.held) * channels


# a window's fp16 tokens count on every layer, on a sliding one against only the tokens it holds
_SMALLER_WINDOW = {False: "", True: " or a smaller fp16 window (:rN)"}


def _units_budget(avg_bits: float, hold: _Holding, channels: int, sinks: int, window: int, name: str) -> float:
    """What the units (every layer's keys and values) may store in all: the budget less the shared part."""
    budget = avg_bits * hold.elements(channels) - hold.shared(channels, sinks, window)
    if budget <= 0:
        # a longer context dilutes the sinks and window only on layers that hold every token
        longer = "" if all(hold.sliding) and all(h < hold.tokens for h in hold.held) else " or a longer context"
        raise MethodError(f"{name}: the fp16 sinks and window alone store more than {avg_bits:g} bits per element at "
                          f"{hold.tokens} tokens; give a larger average or a smaller window{longer}")
    return budget


def _average(spent_units: float, hold: _Holding, channels: int, sinks: int, window: int) -> float:
    """Bits per element the cache holds: every layer's elements held, a sliding layer's only its window's."""
    return (spent_units + hold.shared(channels, sinks, window)) / hold.elements(channels)


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


def allocate(recipe: Recipe, avg_bits: float, sinks: int = 1, tokens: int = DEFAULT_CONTEXT,
             proxy: str = "fisher", window: int = 0) -> Allocation:
    """The choice of every layer's keys and values minimising the summed predicted loss at `avg_bits` stored bits
    per element in a cache of `tokens` tokens (`unit_bits`, `shared_bits`: every byte the cache holds).

    proxy: "fisher", the codebooks' Fisher-weighted objectives; "kl", the same times each unit's measured scale
    (`measured_scales`, from the KL divergences `calibrate.sensitivity.measure_sensitivity` stored in the recipe).
    window: recent tokens held in fp16 beside their codes (`:rN`); their bits count against `avg_bits`.

    Raises:
        MethodError: a budget below what the cheapest choice everywhere stores.
    """
    fp = recipe.meta["model"]["fingerprint"]
    layers, channels = int(fp["layers"]), int(fp["kv_heads"]) * int(fp["head_dim"])
    hold = _Holding.of(recipe, tokens, sinks)
    held, sinks_at = hold.held, hold.kept
    options = _options(recipe)
    scales = measured_scales(recipe, sinks) if proxy == "kl" else np.ones((layers, 2))
    units = [(layer, kv) for layer in range(layers) for kv in ("k", "v")]
    # per unit, the options that are not dominated (less loss for no more bits); cost in bits, loss
    table = []
    for layer, kv in units:
        rows = sorted(((unit_bits(kv, c, held[layer], channels, sinks_at[layer]),
                        scales[layer, "kv".index(kv)] * _objective(recipe, layer, kv, c), c) for c in options),
                      key=lambda r: (r[0], r[1]))
        kept = []
        for cost, loss, c in rows:
            if not kept or loss < kept[-1][1]:
                kept.append((cost, loss, c))
        table.append(kept)
    name = f"nuq@{avg_bits:g}" + (f":r{window}" if window else "")
    budget = _units_budget(avg_bits, hold, channels, sinks, window, name)
    cheapest = sum(rows[0][0] for rows in table)
    if cheapest > budget:
        least = _average(cheapest, hold, channels, sinks, window)
        raise MethodError(f"{name}: below what this recipe can store at {tokens} tokens ({least:.3f} bits with every "
                          "layer at its cheapest choice); give a larger average" + _SMALLER_WINDOW[bool(window)])

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
                      _average(spent, hold, channels, sinks, window), window)


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


def allocate_channels(recipe: Recipe, avg_bits: float, sinks: int = 1, tokens: int = DEFAULT_CONTEXT,
                      proxy: str = "fisher", window: int = 0) -> Allocation:
    """Each channel's width (`CHANNEL_BITS`) and each layer's key / value outlier fraction minimising the summed
    per-channel Fisher-weighted error at `avg_bits` stored bits per element at `tokens` tokens (see the module
    docstring). proxy "kl": each unit's errors weighted by its measured scale (`measured_scales`). window: as
    `allocate`.

    What a unit with widths of its own stores besides its codes is counted as the cache holds it: every codebook
    up to its widest width (`CAPS`: a unit may stop at 4 or 5 bits, and its decode table then holds 16 or 32
    levels per channel instead of 64), the table, and each slot's codes packed into whole 32-bit words, whose
    padding the choice fills with the one-bit upgrades that save the most.

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
    hold = _Holding.of(recipe, tokens, sinks)
    held, sinks_at = hold.held, hold.kept
    fractions = sorted(float(f) for f in recipe.meta.get("settings", {}).get("fractions", (0.0,)))
    units = [(layer, kv) for layer in range(layers) for kv in ("k", "v")]
    held_u = np.array([float(held[layer]) for layer, _ in units])  # [U]: the tokens each unit holds
    rows = np.arange(len(units))
    # err [U, F, C, W]: each channel's Fisher-weighted error at each width
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
    # per-channel variants: (fraction, cap); a slot's codes cost a unit's held tokens in bits per bit, rounded up
    # to whole words
    variants = [(fi, cap) for fi in range(len(fractions)) for cap in CAPS if cap <= widths[-1]]
    v_frac = np.array([fi for fi, _ in variants])
    allowed = np.array([widths <= cap for _, cap in variants])  # [V, W]
    var_err = np.where(allowed[None, :, None, :], err[:, v_frac], np.inf)  # [U, V, C, W]
    word = 32.0 * held_u  # [U]: one more int32 word in every slot a unit holds

    def reference(cap: int) -> tuple[int, ...]:  # widths that use every codebook up to `cap`
        return tuple(range(1, cap + 1)) + (1,) * (channels - cap)

    fixed = np.array([[unit_bits(kv, Choice(cap, fractions[fi], reference(cap)), held[layer], channels, sinks_at[layer])
                       - 32.0 * held[layer] * storage.slot_words(channels, Choice(cap, 0.0, reference(cap)))
                       for fi, cap in variants] for layer, kv in units])  # [U, V]: all but the codes
    # one width for the whole unit [U, F, W]: its loss and everything it stores (read where `whole` allows it)
    uniform_loss = err.sum(2)
    uniform_cost = np.array([[[unit_bits(kv, Choice(int(w), f), held[layer], channels, sinks_at[layer]) for w in widths]
                              for f in fractions] for layer, kv in units])
    name = f"nuq@{avg_bits:g}" + (f":r{window}" if window else "") + ":chan"
    budget = _units_budget(avg_bits, hold, channels, sinks, window, name)
    cheapest = float(np.minimum((fixed + (word * math.ceil(channels * widths[0] / 32))[:, None]).min(1),
                                uniform_cost[..., whole].min((1, 2))).sum())
    if cheapest > budget:
        least = _average(cheapest, hold, channels, sinks, window)
        raise MethodError(f"{name}: below what this recipe can store at {tokens} tokens ({least:.3f} bits with every "
                          f"channel at {widths[0]} bit); give a larger average" + _SMALLER_WINDOW[bool(window)])

    def channel_cost(w_idx: np.ndarray) -> np.ndarray:
        """What the codes of widths w_idx [U, ..., C] cost each unit [U, ...]."""
        words = np.ceil(widths[w_idx].sum(-1) / 32)
        return word.reshape((-1,) + (1,) * (words.ndim - 1)) * words

    def pick(lam: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per unit: its variant (or, taking one width for all, its fraction) [U], its channels' widths [U, C] and
        whether it takes one width for all [U]."""
        w_idx = np.argmin(var_err + lam * held_u[:, None, None, None] * widths, axis=-1)  # [U, V, C]
        per_channel = np.take_along_axis(var_err, w_idx[..., None], -1)[..., 0].sum(-1) + lam * (
            channel_cost(w_idx) + fixed)  # [U, V]
        v_idx = per_channel.argmin(1)
        best = per_channel[rows, v_idx]
        flat = np.where(whole, uniform_loss + lam * uniform_cost, np.inf).reshape(len(units), -1)  # [U, F * W]
        u_idx = flat.argmin(1)
        uniform = flat[rows, u_idx] <= best * (1 + 1e-12)  # an equal loss: the cheaper, plain, choice
        u_f, u_w = np.divmod(u_idx, len(widths))
        w_idx = np.where(uniform[:, None], u_w[:, None], w_idx[rows, v_idx])
        return np.where(uniform, u_f, v_idx), w_idx, uniform

    def cost(sel: np.ndarray, w_idx: np.ndarray, uniform: np.ndarray) -> np.ndarray:
        """[U]: what each unit stores."""
        u_f = np.minimum(sel, len(fractions) - 1)
        return np.where(uniform, uniform_cost[rows, u_f, w_idx[:, 0]], fixed[rows, np.minimum(sel, len(variants) - 1)]
                        + channel_cost(w_idx))

    # errors are sums of F (x - x^)^2, small numbers: the multiplier search starts low
    sel, w_idx, uniform = pick(_fitting_multiplier(lambda lam: cost(*pick(lam)).sum() <= budget, start=1e-12))
    # what is left, counted exactly (each unit's codebooks and table as its widths need them): a word more for a
    # unit with widths of its own, filled with its best one-bit upgrades, or a wider plain choice
    frac = np.where(uniform, sel, v_frac[np.minimum(sel, len(variants) - 1)])  # [U]: each unit's fraction index
    chosen = err[rows, frac]  # [U, C, W]: errors at each unit's fraction, every width in reach

    def gains(u: int, w: np.ndarray) -> np.ndarray:
        """[C]: what one bit more saves in each channel of unit u at widths w (-inf where it cannot grow)."""
        now = np.take_along_axis(chosen[u], w[:, None], -1)[:, 0]
        up = np.take_along_axis(chosen[u], np.minimum(w + 1, len(widths) - 1)[:, None], -1)[:, 0]
        return np.where(w + 1 < len(widths), now - up, -np.inf)

    def filled(u: int, w: np.ndarray) -> np.ndarray:
        """Widths w with the padding of their last code word spent on the best one-bit upgrades (free bits)."""
        w, top = w.copy(), w.max()  # free bits: the widest width (its decode table) stays
        for _ in range(int(32 * math.ceil(widths[w].sum() / 32) - widths[w].sum())):
            g = np.where(w < top, gains(u, w), -np.inf)
            c = int(g.argmax())
            if not g[c] > 0:
                break
            w[c] += 1
        return w

    def exact(u: int, w: np.ndarray) -> float:
        (layer, kv), f = units[u], fractions[frac[u]]
        return unit_bits(kv, Choice(int(widths[w].max()), f, tuple(int(x) for x in widths[w])), held[layer],
                         channels, sinks_at[layer])

    def loss(u: int, w: np.ndarray) -> float:
        return float(np.take_along_axis(chosen[u], w[:, None], -1).sum())

    spends = np.array([float(uniform_cost[u, frac[u], w_idx[u, 0]]) if uniform[u] else 0.0
                       for u in range(len(units))])
    for u in np.flatnonzero(~uniform):
        w_idx[u] = filled(u, w_idx[u])
        spends[u] = exact(u, w_idx[u])
    while True:
        spent = float(spends.sum())
        best = None  # (loss saved per bit, unit, new widths or new plain (fraction, width), its cost)
        for u in range(len(units)):
            if uniform[u]:
                f, w = int(frac[u]), int(w_idx[u, 0])
                extra = uniform_cost[u] - uniform_cost[u, f, w]
                saved = uniform_loss[u, f, w] - uniform_loss[u]
                ok = whole[None, :] & (extra > 0) & (saved > 0) & (spent + extra <= budget)
                if ok.any():
                    ratio = np.where(ok, saved / np.where(extra > 0, extra, 1), -np.inf)
                    j = np.unravel_index(int(ratio.argmax()), ratio.shape)
                    if best is None or ratio[j] > best[0]:
                        best = (float(ratio[j]), u, (int(j[0]), int(j[1])), float(uniform_cost[u][j]))
                continue
            g = gains(u, w_idx[u])
            if not g.max() > 0:
                continue
            w = w_idx[u].copy()
            w[int(g.argmax())] += 1
            w = filled(u, w)
            extra = exact(u, w) - spends[u]
            saved = loss(u, w_idx[u]) - loss(u, w)
            if extra > 0 and saved > 0 and spent + extra <= budget and (best is None or saved / extra > best[0]):
                best = (saved / extra, u, w, exact(u, w))
        if best is None:
            break
        _, u, new, spends[u] = best
        if uniform[u]:
            frac[u], w_idx[u] = new
        else:
            w_idx[u] = new
    predicted = float(sum(uniform_loss[u, frac[u], w_idx[u, 0]] if uniform[u] else loss(u, w_idx[u])
                          for u in range(len(units))))
    picks = []
    for u in range(len(units)):
        if uniform[u]:
            picks.append(Choice(int(widths[w_idx[u, 0]]), fractions[frac[u]]))
        else:
            w = widths[w_idx[u]]
            picks.append(Choice(int(w.max()), fractions[frac[u]], tuple(int(x) for x in w)))
    # what the choice holds: the codebooks and the table of the widths it uses (charged above up to each cap)
    spent = sum(unit_bits(kv, c, held[layer], channels, sinks_at[layer]) for (layer, kv), c in zip(units, picks))
    return Allocation(float(avg_bits), tokens, tuple(picks[0::2]), tuple(picks[1::2]), predicted,
                      _average(spent, hold, channels, sinks, window), window)


STORAGE_VERSION = 4  # stored choices counted as `unit_bits` counts (words, tables, key headroom) at each layer's
# held tokens (a sliding layer's window); older ones are redone


def recipe_allocation(recipe: Recipe, avg_bits: float, sinks: int = 1, proxy: str = "fisher",
                      unit: str = "layer", window: int = 0, tokens: int = DEFAULT_CONTEXT) -> Allocation:
    """The recipe's stored choice for this budget, sink count, proxy, unit, window and context (`calibrate
    --avg-bits`, `kvsqueeze budget`), or the same computed now (a choice stored by a version that counted storage
    otherwise is computed again)."""
    name = budget_key(avg_bits, sinks, proxy, unit, window, tokens)
    stored = recipe.meta.get("budgets", {}).get(name)
    if stored is not None and stored.get("storage") == STORAGE_VERSION:
        alloc = Allocation.from_dict(stored)
        fp = recipe.meta["model"]["fingerprint"]
        channels = fp["kv_heads"] * fp["head_dim"]
        hold = _Holding.of(recipe, alloc.tokens, sinks)
        spent = sum(unit_bits(kv, c, n, channels, s) for k, v, n, s in zip(alloc.keys, alloc.values, hold.held,
                                                                           hold.kept)
                    for kv, c in (("k", k), ("v", v)))
        held = _average(spent, hold, channels, sinks, alloc.window)
        if alloc.tokens != tokens or alloc.window != window or not math.isclose(held, alloc.bits, rel_tol=1e-9):
            raise RecipeError(f"recipe field budgets.{name} does not add up: its choices store {held:.4f} bits at "
                              f"{alloc.tokens} tokens, it records {alloc.bits:.4f} (an edited or half-written "
                              "recipe); recalibrate, or drop that entry to have the budget chosen again")
        return alloc
    windows = tuple(recipe.meta["model"]["fingerprint"].get("layer_windows") or ())  # named by the model later
    key = (id(recipe), float(avg_bits), sinks, proxy, unit, window, tokens, windows)
    held = _COMPUTED.get(key)
    if held is None or held[0] is not recipe:
        fn = allocate_channels if unit == "channel" else allocate
        alloc = fn(recipe, avg_bits, sinks, tokens=tokens, proxy=proxy, window=window)
        held = _COMPUTED[key] = (recipe, alloc)
    return held[1]


_COMPUTED: dict[tuple, tuple[Recipe, Allocation]] = {}  # (recipe id, budget, ..., tokens) -> (recipe, choice)


def drop_kl_budgets(recipe: Recipe, sinks: int) -> list[str]:
    """Forget every choice made from the recipe's KL sensitivities of `sinks` sinks (stored in it, or computed in
    this process): called when that table is measured again, so that no `:kl` budget keeps a choice of the old
    one. The stored names dropped."""
    sink = f"sink{sinks}" if sinks != 1 else None
    budgets = recipe.meta.get("budgets", {})
    dropped = [k for k in budgets
               if "kl" in k.split(":") and (sink in k.split(":") if sink else not any(
                   p.startswith("sink") for p in k.split(":")))]
    for k in dropped:
        del budgets[k]
    for key in [k for k, (r, _) in _COMPUTED.items() if r is recipe and k[2] == sinks and k[3] == "kl"]:
        del _COMPUTED[key]
    return dropped


def budget_key(avg_bits: float, sinks: int, proxy: str = "fisher", unit: str = "layer", window: int = 0,
               tokens: int = DEFAULT_CONTEXT) -> str:
    """The name a choice is stored under in a recipe: the budget's method name without 'nuq@'."""
    return (f"{avg_bits:g}" + (f":sink{sinks}" if sinks != 1 else "") + (f":r{window}" if window else "")
            + (":kl" if proxy == "kl" else "") + (":chan" if unit == "channel" else "") + context_flag(tokens))


def spec_allocation(spec: MethodSpec, recipe: Recipe) -> Allocation:
    """The choice of a budgeted method (`nuq@B...`) for the context it names."""
    if recipe is None:
        raise RecipeError(f"method {spec.name!r} chooses each layer's bits from the recipe's Fisher objectives: "
                          "pass --recipe DIR")
    return recipe_allocation(recipe, spec.budget, spec.sinks, spec.budget_proxy, spec.budget_unit, spec.window,
                             spec.budget_context)


def layer_choices(spec: MethodSpec, recipe: Recipe, layer: int) -> tuple[Choice, Choice]:
    """The key and value choice of one layer for a budgeted method."""
    if spec.budget is None:
        return Choice(spec.k_bits, spec.outlier_fraction), Choice(spec.v_bits, spec.outlier_fraction)
    return spec_allocation(spec, recipe).layer(layer)


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
