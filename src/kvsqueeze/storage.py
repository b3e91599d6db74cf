"""What a method stores, in bytes: the one count every report, budget and plan reads.

The compressed cache (`cache.store.KVStore`) holds, per layer, for keys ("k") and values ("v") separately:

* codes: each quantized slot's codes packed into whole int32 words (`packing`: `words_per_vector` for one width,
  `mixed_words` for a width per channel; the last word of a slot is padded).
* scales: keys an fp16 scale and zero-point per channel (offline); values an fp16 pair per quantized slot.
* outlier_values, outlier_indices: exact fp16 values and int16 channel indices of the sparse outliers; values
  with per-token top-k and keys with a slot count (`:kslotsN`) keep the same count in every slot (padding
  entries in sink slots, reported there).
* pointers: CSC / CSR pointers, int32 (int64 past 2**31 entries), one per slot plus one, where counts vary.
* codebook: the float32 levels decoding reads (every width's with a width per channel, and a byte per channel
  for its width), the keys' float32 clipping range [C] twice, and per-matrix value thresholds.
* decode_tables: with a width per channel, the [C, 2**widest] float32 table of every channel's levels and the
  int32 bit offsets [C + 1] the kernels read: derived from the codebooks, but held, so counted.

and, per layer, for both tensors:

* sinks: fp16 keys and values of each row's first real tokens.
* fp16_window: fp16 copies of each row's most recent real tokens (`:rN`), beside their codes.
* sink_slots: what sink tokens leave in the rectangular grids (codes, value scales, pointers and padding
  outliers of their slots) and the int32 table of sink and window slots [B, sinks + window].
* positions: the RoPE position of each slot, int32 [T, B], once for every full layer and once more in each
  sliding-window layer (for the tokens it keeps).

`layer_bytes` counts that from a layout and the tokens held; the compressed cache's `MemoryReport` equals it
byte for byte (tests/test_storage.py), and the bit budget (`budget`), the simulated path's average bits, the
memory planner and `benchmarks/memory.py` read it. Families the compressed cache does not hold (KIVI, grouped,
TurboQuant) and fp16 have a `model_bits` count of what their own layout would store.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .numerics.outliers import max_outliers_per_side, topk_per_side  # noqa: F401  (used and re-exported)

COMPONENTS = ("codes", "scales", "outlier_values", "outlier_indices", "pointers", "sinks", "fp16_window",
              "codebook", "decode_tables", "sink_slots", "positions")
FP16_BYTES = 2
INDEX_BYTES = 2  # an outlier's channel, int16
WORD_BYTES = 4  # codes are packed into int32 words
FLOAT_BYTES = 4  # levels, clipping ranges and decode tables are float32 (bit-exact with the recipe)
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Choice:
    """How one layer stores its keys or its values: a width, an outlier fraction, and maybe a width per channel."""

    bits: int  # the width of every channel; with `widths`, the widest
    fraction: float  # outliers kept exactly (per channel for keys, per token for values)
    widths: tuple[int, ...] | None = None  # each channel's own width (':chan' budgets)

    def label(self) -> str:
        bits = f"{self.mean_bits:.2f}" if self.widths is not None else f"{self.bits}"
        return bits + (f"-{100 * self.fraction:g}%" if self.fraction else "")

    @property
    def mean_bits(self) -> float:
        return float(np.mean(self.widths)) if self.widths is not None else float(self.bits)



@dataclass(frozen=True)
class Layout:
    """How the compressed cache holds one layer's keys ("k": per channel) or values ("v": per token)."""

    kv: str
    choice: Choice
    scope: str = "vector"  # outlier thresholds per vector, or one pair per "matrix"
    slots: int = 0  # keys: a fixed count of exact elements per token (`:kslotsN`)

    @property
    def fixed_outliers(self) -> bool:
        """Whether every slot keeps the same count of outliers (per-token top-k values, a key slot count): no
        pointers then."""
        if self.choice.fraction <= 0:
            return False
        return self.scope == "vector" if self.kv == "v" else self.slots > 0

    def outliers_per_slot(self, channels: int) -> int:
        """Outliers every slot keeps where the count is fixed (`fixed_outliers`)."""
        return self.slots if self.kv == "k" else 2 * topk_per_side(self.choice.fraction, channels)


def slot_words(channels: int, choice: Choice) -> int:
    """int32 words one slot's codes take (padding of the last word included)."""
    # one width: packed in groups of 32 codes (only the last group is padded); widths of their own: back to back
    bits = sum(choice.widths) if choice.widths is not None else math.ceil(channels / 32) * 32 * choice.bits
    return -(-bits // 32)


def nominal_outliers(layout: Layout, channels: int, coded: int) -> int:
    """Outliers a tensor keeps over `coded` quantized slots when every vector keeps its nominal fraction (keys'
    per-channel thresholds keep about that many; a key slot count and values' top-k keep exactly that many)."""
    f = layout.choice.fraction
    if f <= 0:
        return 0
    if layout.kv == "k":
        return layout.slots * coded if layout.slots else round(f * coded * channels)
    return 2 * topk_per_side(f, channels) * coded if layout.scope == "vector" else round(f * coded * channels)


def tensor_bytes(layout: Layout, channels: int, slots: int, sinks: int, outliers: int | None = None) -> dict:
    """Bytes one layer's keys or values hold, by component, over `slots` slots of which `sinks` are sink slots.

    outliers: the count held (default `nominal_outliers`); ignored where the count is fixed. The sink slots'
    share of the grids is the `sink_slots` entry (with neither the sink-and-window table nor the fp16 sinks).
    """
    c, choice = channels, layout.choice
    coded = slots - sinks
    words = slot_words(c, choice)
    out = dict.fromkeys(COMPONENTS, 0)
    out["codes"] = coded * words * WORD_BYTES
    out["scales"] = 2 * FP16_BYTES * (c if layout.kv == "k" else coded)
    if choice.widths is None:
        out["codebook"] = FLOAT_BYTES * 2**choice.bits
    else:
        out["codebook"] = FLOAT_BYTES * sum(2**w for w in set(choice.widths)) + c
        out["decode_tables"] = FLOAT_BYTES * c * 2 ** max(choice.widths) + 4 * (c + 1)
    if layout.kv == "k":
        out["codebook"] += 2 * FLOAT_BYTES * c  # the clipping range encoding reads
    elif layout.scope == "matrix" and choice.fraction > 0:
        out["codebook"] += 2 * FLOAT_BYTES
    pointer = 0
    if choice.fraction > 0:
        if layout.fixed_outliers:
            per_slot = layout.outliers_per_slot(c)
            n = per_slot * coded
            out["sink_slots"] += (FP16_BYTES + INDEX_BYTES) * per_slot * sinks
        else:
            n = nominal_outliers(layout, c, coded) if outliers is None else int(outliers)
            pointer = 8 if n > INT32_MAX else 4
            out["pointers"] = pointer * (coded + 1)
        out["outlier_values"] = FP16_BYTES * n
        out["outlier_indices"] = INDEX_BYTES * n
    out["sink_slots"] += sinks * (words * WORD_BYTES + (FP16_BYTES * 2 if layout.kv == "v" else 0) + pointer)
    return out


@dataclass(frozen=True)
class Rows:
    """The tokens a cache holds: `tokens` slots per row, `padding[b]` of them left padding in row b, and the
    last `held` of them (a sliding-window layer's) or all."""

    tokens: int
    padding: tuple[int, ...] = (0,)

    @property
    def batch(self) -> int:
        return len(self.padding)

    def counts(self, sinks: int, window: int, held: int | None = None) -> tuple[int, int]:
        """(sink tokens, fp16 window entries) held, summed over rows: a row's sinks are its first real tokens, its
        window its last real non-sink ones; a sliding layer holding the last `held` slots keeps those among them."""
        held = self.tokens if held is None else held
        first = self.tokens - held  # slots before this are gone
        n_sinks = n_window = 0
        for pad in self.padding:
            real = self.tokens - pad
            s = min(sinks, real)
            n_sinks += max(0, pad + s - max(pad, first))
            w = min(window, real - s)
            n_window += max(0, self.tokens - max(self.tokens - w, first))
        return n_sinks, n_window


def layer_bytes(k: Layout, v: Layout, channels: int, rows: Rows, sinks: int, window: int,
                held: int | None = None, k_outliers: int | None = None, v_outliers: int | None = None,
                own_positions: bool = False) -> dict:
    """Bytes one layer of the compressed cache holds (see the module docstring), by component.

    held: slots a sliding-window layer keeps of each row (default: every one); own_positions: whether this
    layer keeps positions of its own (a sliding layer does; full layers share one log, counted by `cache_bytes`).
    """
    held = rows.tokens if held is None else held
    slots = held * rows.batch
    n_sinks, n_window = rows.counts(sinks, window, held)
    out = dict.fromkeys(COMPONENTS, 0)
    for layout, outliers in ((k, k_outliers), (v, v_outliers)):
        for name, n in tensor_bytes(layout, channels, slots, n_sinks, outliers).items():
            out[name] += n
    out["sinks"] = 2 * FP16_BYTES * n_sinks * channels
    out["fp16_window"] = 2 * FP16_BYTES * n_window * channels
    out["sink_slots"] += 4 * rows.batch * (sinks + window)
    if own_positions:
        out["positions"] = 4 * slots
    return out


def held_by_layer(windows, tokens: int) -> list[int | None]:
    """Slots each layer keeps of a row of `tokens` (what `cache_bytes`'s `held` takes): None for a full layer
    (`windows` None there, every slot), a sliding layer's last window - 1, as the compressed cache and
    transformers' `DynamicCache` keep them."""
    return [None if w is None else min(tokens, int(w) - 1) for w in windows]


def tokens_held(held: list[int | None] | None, tokens: int, layers: int) -> int:
    """Tokens a row of `tokens` leaves in the cache, summed over its `layers` (`held`: `held_by_layer`'s list, None
    for every layer full): what bits per element held divide by."""
    return layers * tokens if held is None else sum(tokens if h is None else h for h in held)


def positions_bytes(rows: Rows) -> int:
    """The position log that every full layer of a cache shares, int32 [T, B]."""
    return 4 * rows.tokens * rows.batch


def fp16_bytes(channels: int, rows: Rows, held: int | None = None) -> dict:
    """One layer of the fp16 cache: post-RoPE keys and values in fp16, nothing else."""
    out = dict.fromkeys(COMPONENTS, 0)
    out["codes"] = 2 * FP16_BYTES * (rows.tokens if held is None else held) * rows.batch * channels
    return out


def total(components: dict) -> int:
    return sum(components.values())
