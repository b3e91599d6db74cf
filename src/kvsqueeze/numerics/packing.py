"""Exact bit-packing of small integer quantization codes into int32 words.

The KV cache stores 2/3/4-bit codes, so they are packed densely along the last
dimension: every group of 32 codes of `bits` bits becomes exactly `bits`
int32 words, read as one little-endian bit stream. Code `i` of a group
occupies stream bits `[i*bits, (i+1)*bits)`, word `j` holds stream bits
`[32j, 32j+32)` and bit 0 is the least significant bit of a word, so a 3-bit
code may straddle two words. Only the final group is padded (with zero codes).
Words are int32 because torch lacks uint32 arithmetic on many ops; they are raw
bit patterns, so a word with its top bit set reads as negative.

Codes of different widths (`pack_mixed`, the channels of a `nuq@AVG:chan` budget) are one such stream too,
each code right after the one before it (`code_offsets`); with equal widths it is `pack_codes`' stream.

`pack_codes`/`unpack_codes` are the vectorized implementations (the tests
hold them to slow, loop-based oracles of their own).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = [
    "GROUP_SIZE",
    "OUTLIER_CODE",
    "MAX_BITS",
    "words_per_vector",
    "pack_codes",
    "unpack_codes",
    "code_offsets",
    "mixed_words",
    "pack_mixed",
    "unpack_mixed",
]

GROUP_SIZE = 32
# the code stored under every element kept exactly (an outlier or a sink slot): the kernels add that element's
# exact value to the decode of this code's level, so every store and every page writes this one code there
OUTLIER_CODE = 0
MAX_BITS = 8

_WORD_MASK = 0xFFFFFFFF


def _check_bits(bits: int) -> None:
    """Raise ValueError unless bits is a plain int in 1..MAX_BITS."""
    # bool is an int subclass; True as a bit width is almost certainly a bug.
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise ValueError(
            f"bits must be an int in 1..{MAX_BITS}, got {bits!r} of type "
            f"{type(bits).__name__}; pass the code width as a Python int."
        )
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(
            f"bits must be in 1..{MAX_BITS}, got {bits}; codes wider than "
            f"{MAX_BITS} bits are not supported by this packer."
        )


def _check_n(n: int) -> None:
    """Raise ValueError unless n is a non-negative plain int."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(
            f"n (number of codes per vector) must be an int, got {n!r} of type "
            f"{type(n).__name__}."
        )
    if n < 0:
        raise ValueError(
            f"n (number of codes per vector) must be >= 0, got {n}; pass the "
            "length of the last dimension that was given to pack_codes."
        )


def _check_codes(codes: torch.Tensor, bits: int) -> None:
    """Raise ValueError unless codes is an integer tensor with values in [0, 2**bits)."""
    if not isinstance(codes, torch.Tensor):
        raise ValueError(
            f"codes must be a torch.Tensor, got {type(codes).__name__}; wrap it "
            "with torch.as_tensor(..., dtype=torch.uint8)."
        )
    if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
        raise ValueError(
            f"codes must have an integer dtype (e.g. torch.uint8), got {codes.dtype}; "
            "round and cast the quantized values with .to(torch.uint8) first."
        )
    if codes.dim() == 0:
        raise ValueError(
            "codes must have at least one dimension (codes are packed along the "
            "last one), got a 0-d tensor; use codes.reshape(1)."
        )
    if codes.numel() == 0:
        return
    # int64 holds every value of every narrower dtype; a huge uint64 wraps to a
    # negative number, which the range check below still rejects.
    wide = codes.to(torch.int64)
    lo, hi = int(wide.min()), int(wide.max())
    if lo < 0 or hi >= 1 << bits:
        raise ValueError(
            f"codes out of range for bits={bits}: expected values in "
            f"[0, {(1 << bits) - 1}], got min {lo} and max {hi}; clamp the codes "
            "or pack them with a larger bits."
        )


def _check_words(words: torch.Tensor, bits: int, n: int) -> None:
    """Raise ValueError unless words is an int32 tensor whose last dim fits n codes."""
    if not isinstance(words, torch.Tensor):
        raise ValueError(f"words must be a torch.Tensor, got {type(words).__name__}.")
    if words.dtype != torch.int32:
        raise ValueError(
            f"words must have dtype torch.int32 (as returned by pack_codes), got "
            f"{words.dtype}; do not cast the packed words."
        )
    if words.dim() == 0:
        raise ValueError(
            "words must have at least one dimension (words lie along the last "
            "one), got a 0-d tensor."
        )
    expected = words_per_vector(n, bits)
    if words.shape[-1] != expected:
        raise ValueError(
            f"words last dimension is {words.shape[-1]}, expected "
            f"words_per_vector(n={n}, bits={bits}) = {expected}; check that n and "
            "bits match the values used in pack_codes."
        )


def words_per_vector(n: int, bits: int) -> int:
    """Number of int32 words that hold n packed codes of the given width.

    Args:
        n: number of codes along the packed dimension, >= 0.
        bits: code width, 1..8.

    Returns:
        ceil(n / 32) * bits.
    """
    _check_n(n)
    _check_bits(bits)
    return -(-n // GROUP_SIZE) * bits


def _stream_layout(bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Word index and bit shift of each of the 32 code slots in a group.

    Args:
        bits: code width, 1..8.
        device: device for the returned tensors.

    Returns:
        (word, shift): both int64 [32]; slot i starts at bit shift[i] of word word[i].
    """
    offset = torch.arange(GROUP_SIZE, dtype=torch.int64, device=device) * bits
    return offset // 32, offset % 32


def _to_int32_bits(values: torch.Tensor) -> torch.Tensor:
    """Reinterpret int64 values in [0, 2**32) as int32 bit patterns."""
    # Explicit wrap: an out-of-range int64 -> int32 cast is not guaranteed to wrap.
    return torch.where(values >= 1 << 31, values - (1 << 32), values).to(torch.int32)


def pack_codes(codes: torch.Tensor, bits: int, *, check: bool = True) -> torch.Tensor:
    """Pack integer codes along the last dimension into int32 words.

    Args:
        codes: integer tensor (typically uint8) of shape [..., n], values in
            [0, 2**bits). Any layout; non-contiguous inputs are fine.
        bits: code width, 1..8.
        check: read the codes' range first. Reading it waits for the device;
            a caller whose codes are in range by construction (a quantizer's)
            passes False.

    Returns:
        int32 tensor [..., words_per_vector(n, bits)] on codes.device, in the
        group-of-32 little-endian stream format described in the module docstring.
    """
    _check_bits(bits)
    if check:
        _check_codes(codes, bits)
    *lead, n = codes.shape
    n_groups = -(-n // GROUP_SIZE)
    wide = codes.to(torch.int64)
    pad = n_groups * GROUP_SIZE - n
    if pad:
        wide = torch.cat([wide, wide.new_zeros(*lead, pad)], dim=-1)
    wide = wide.reshape(*lead, n_groups, GROUP_SIZE)

    word, shift = _stream_layout(bits, codes.device)
    # code < 2**8 and shift < 32, so the shifted code fits in 40 bits: the low
    # 32 land in word[i], anything above spills into word[i] + 1.
    shifted = wide << shift
    low = shifted & _WORD_MASK
    high = shifted >> 32

    # One spare column absorbs spills from the last slot; it is always zero
    # because a group's codes end exactly at bit 32*bits.
    acc = wide.new_zeros(*lead, n_groups, bits + 1)
    # The slots' bit ranges are disjoint, so adding them is the same as OR-ing.
    acc.scatter_add_(-1, word.expand_as(low), low)
    acc.scatter_add_(-1, (word + 1).expand_as(high), high)
    return _to_int32_bits(acc[..., :bits]).reshape(*lead, n_groups * bits)


def unpack_codes(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Unpack int32 words produced by pack_codes back into codes.

    Args:
        words: int32 tensor [..., words_per_vector(n, bits)]. Any layout.
        bits: code width used when packing, 1..8.
        n: number of codes per vector used when packing, >= 0.

    Returns:
        uint8 tensor [..., n] on words.device; padding codes are dropped.
    """
    _check_bits(bits)
    _check_n(n)
    _check_words(words, bits, n)
    *lead, _ = words.shape
    n_groups = -(-n // GROUP_SIZE)
    # Mask to the unsigned 32-bit pattern so right shifts bring in zeros, not sign bits.
    unsigned = words.to(torch.int64).reshape(*lead, n_groups, bits) & _WORD_MASK
    unsigned = torch.cat([unsigned, unsigned.new_zeros(*lead, n_groups, 1)], dim=-1)

    word, shift = _stream_layout(bits, words.device)
    low = unsigned.index_select(-1, word)
    # Only the bottom 8 bits of the next word can belong to a straddling code;
    # masking first keeps the shift below 2**40, far from int64 overflow.
    high = unsigned.index_select(-1, word + 1) & 0xFF
    codes = ((low | (high << 32)) >> shift) & ((1 << bits) - 1)
    return codes.reshape(*lead, n_groups * GROUP_SIZE)[..., :n].to(torch.uint8)


# ---- a width per code (the channels of a ':chan' bit budget) ---------------------------------------------------
def code_offsets(widths: torch.Tensor) -> torch.Tensor:
    """Stream bit offsets of codes of the given widths, int32 [n + 1]: code c takes bits [off[c], off[c + 1]).

    Codes follow each other with no padding (a code may straddle two words); `pack_mixed` writes them so.
    """
    widths = torch.as_tensor(widths, dtype=torch.int64)
    if widths.dim() != 1 or (widths.numel() and (int(widths.min()) < 1 or int(widths.max()) > MAX_BITS)):
        raise ValueError(f"widths must be a 1-D tensor of code widths in 1..{MAX_BITS}, got {widths.tolist()}")
    return torch.cat([widths.new_zeros(1), widths.cumsum(0)]).to(torch.int32)  # what every kernel reads


def mixed_words(offsets: torch.Tensor) -> int:
    """int32 words that hold one vector of codes laid out by `code_offsets`."""
    return -(-int(offsets[-1]) // 32)


def pack_mixed(codes: torch.Tensor, offsets: torch.Tensor, *, words: int | None = None) -> torch.Tensor:
    """Pack codes [..., n] (code c below 2**(off[c + 1] - off[c])) into int32 words [..., mixed_words(offsets)],
    one little-endian bit stream per vector, as `pack_codes` writes equal widths.

    `words` (`mixed_words(offsets)`) comes from a caller that packs codes in range by construction (a
    quantizer's): neither it nor the codes' widths are then read from the device, which would wait for it."""
    widths = offsets.diff()
    if codes.shape[-1] != widths.numel():
        raise ValueError(f"codes have {codes.shape[-1]} per vector, the offsets describe {widths.numel()}")
    wide = codes.to(torch.int64)
    if words is None:
        if wide.numel() and bool((wide >= (1 << widths.to(wide.device))).any()):
            raise ValueError("a code is wider than its channel's width; clamp the codes or widen the channel")
        words = mixed_words(offsets)
    start = offsets[:-1].to(wide.device, torch.int64)
    shifted = wide << (start % 32)  # below 2**40: the low 32 bits land in its word, the rest in the next
    acc = wide.new_zeros(*wide.shape[:-1], words + 1)
    word = (start // 32).expand_as(shifted)
    acc.scatter_add_(-1, word, shifted & _WORD_MASK)  # disjoint bit ranges: adding is OR-ing
    acc.scatter_add_(-1, word + 1, shifted >> 32)
    return _to_int32_bits(acc[..., :-1])


def unpack_mixed(words: torch.Tensor, offsets: torch.Tensor, *, check: bool = True) -> torch.Tensor:
    """Codes uint8 [..., n] from the words `pack_mixed` wrote with the same offsets (`check` False: their width
    is not held to the offsets, which reading them from the device would wait for)."""
    if words.dtype != torch.int32 or (check and words.shape[-1] != mixed_words(offsets)):
        raise ValueError(f"words must be int32 [..., {mixed_words(offsets)}] as pack_mixed writes them, got "
                         f"{words.dtype} {tuple(words.shape)}")
    unsigned = words.to(torch.int64) & _WORD_MASK
    unsigned = torch.cat([unsigned, unsigned.new_zeros(*unsigned.shape[:-1], 1)], dim=-1)
    start = offsets[:-1].to(words.device, torch.int64)
    low = unsigned.index_select(-1, start // 32)
    high = unsigned.index_select(-1, start // 32 + 1) & 0xFF
    mask = (1 << offsets.diff().to(words.device, torch.int64)) - 1
    return (((low | (high << 32)) >> (start % 32)) & mask).to(torch.uint8)
