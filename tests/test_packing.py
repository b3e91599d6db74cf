"""Tests for kvsqueeze.numerics.packing: exact round trips, the on-disk bit layout, and errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsqueeze.numerics.packing import (
    _WORD_MASK,
    _check_bits,
    _check_codes,
    _check_n,
    _check_words,
    pack_codes,
    unpack_codes,
    words_per_vector,
)


# ---- the oracles: one flat bit stream per vector, written and read bit by bit -------------------------
def pack_codes_reference(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Slow, loop-based pack_codes: the oracle of these tests.

    Writes every code bit by bit into one flat bit array per vector, then reads
    the array back 32 bits at a time. A group of 32 codes fills exactly ``bits``
    words, so one continuous stream per vector is the same as stream-per-group.

    Args:
        codes: integer tensor [..., n], values in [0, 2**bits).
        bits: code width, 1..8.

    Returns:
        int32 tensor [..., words_per_vector(n, bits)] on the CPU.
    """
    _check_bits(bits)
    _check_codes(codes, bits)
    *lead, n = codes.shape
    n_words = words_per_vector(n, bits)
    # Explicit row count: reshape(-1, 0) is ambiguous when n == 0.
    n_rows = int(np.prod(lead, dtype=np.int64))
    rows = codes.to(torch.int64).cpu().numpy().reshape(n_rows, n)
    out = np.zeros((rows.shape[0], n_words), dtype=np.int64)
    for r, row in enumerate(rows):
        stream = np.zeros(n_words * 32, dtype=np.int64)
        for i, code in enumerate(row):
            for b in range(bits):
                stream[i * bits + b] = (int(code) >> b) & 1
        for j in range(n_words):
            value = 0
            for k in range(32):
                value |= int(stream[32 * j + k]) << k
            out[r, j] = value - (1 << 32) if value >= 1 << 31 else value
    return torch.from_numpy(out.astype(np.int32)).reshape(*lead, n_words)


def unpack_codes_reference(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Slow, loop-based unpack_codes: the oracle of these tests.

    Args:
        words: int32 tensor [..., words_per_vector(n, bits)].
        bits: code width used when packing, 1..8.
        n: number of codes per vector, >= 0.

    Returns:
        uint8 tensor [..., n] on the CPU.
    """
    _check_bits(bits)
    _check_n(n)
    _check_words(words, bits, n)
    *lead, n_words = words.shape
    n_rows = int(np.prod(lead, dtype=np.int64))
    rows = words.cpu().numpy().reshape(n_rows, n_words)
    out = np.zeros((rows.shape[0], n), dtype=np.uint8)
    for r, row in enumerate(rows):
        stream = []
        for word in row:
            unsigned = int(word) & _WORD_MASK
            stream.extend((unsigned >> k) & 1 for k in range(32))
        for i in range(n):
            out[r, i] = sum(stream[i * bits + b] << b for b in range(bits))
    return torch.from_numpy(out).reshape(*lead, n)


ALL_BITS = list(range(1, 9))
LENGTHS = [0, 1, 31, 32, 33, 64, 100, 1000]

# The loop-based reference is slow; small leading shapes keep each example cheap.
leading_shapes = st.lists(st.integers(0, 3), min_size=0, max_size=2).map(tuple)


def _make_codes(lead: tuple[int, ...], n: int, bits: int, seed: int, fill: str) -> torch.Tensor:
    """Codes drawn from a seeded generator (much faster than hypothesis lists of ints)."""
    if fill == "zeros":
        return torch.zeros(*lead, n, dtype=torch.uint8)
    if fill == "max":
        return torch.full((*lead, n), (1 << bits) - 1, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << bits, (*lead, n), generator=gen, dtype=torch.uint8)


codes_cases = st.builds(
    lambda bits, n, lead, seed, fill: (bits, n, lead, _make_codes(lead, n, bits, seed, fill)),
    st.sampled_from(ALL_BITS),
    st.sampled_from(LENGTHS),
    leading_shapes,
    st.integers(0, 2**32 - 1),
    st.sampled_from(["random", "random", "zeros", "max"]),
)


@settings(max_examples=60, deadline=None)
@given(codes_cases)
def test_round_trip_and_matches_reference(case):
    bits, n, lead, codes = case
    words = pack_codes(codes, bits)
    assert words.dtype == torch.int32
    assert words.shape == (*lead, words_per_vector(n, bits))
    assert torch.equal(words, pack_codes_reference(codes, bits))

    out = unpack_codes(words, bits, n)
    assert out.dtype == torch.uint8
    assert torch.equal(out, codes)
    assert torch.equal(unpack_codes_reference(words, bits, n), codes)


@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("n", LENGTHS)
def test_round_trip_every_bits_and_length(bits, n):
    # Deterministic sweep so every (bits, n) pair is covered, not just sampled.
    codes = _make_codes((2,), n, bits, seed=bits * 1000 + n, fill="random")
    words = pack_codes(codes, bits)
    assert words.shape == (2, words_per_vector(n, bits))
    assert torch.equal(unpack_codes(words, bits, n), codes)


@pytest.mark.parametrize("bits", ALL_BITS)
def test_fast_unpack_matches_reference_on_arbitrary_words(bits):
    # Any bit pattern is a valid packed vector when n fills whole groups, so
    # random words check unpack independently of pack.
    gen = torch.Generator().manual_seed(bits)
    words = torch.randint(-(2**31), 2**31, (3, 2 * bits), generator=gen, dtype=torch.int64)
    words = words.to(torch.int32)
    assert torch.equal(unpack_codes(words, bits, 64), unpack_codes_reference(words, bits, 64))
    assert torch.equal(pack_codes(unpack_codes(words, bits, 64), bits), words)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
def test_accepts_any_integer_dtype(dtype):
    codes = torch.arange(40, dtype=torch.int64).remainder(8)
    expected = pack_codes(codes.to(torch.uint8), 3)
    assert torch.equal(pack_codes(codes.to(dtype), 3), expected)


def test_words_per_vector():
    assert words_per_vector(0, 3) == 0
    assert words_per_vector(1, 3) == 3
    assert words_per_vector(32, 3) == 3
    assert words_per_vector(33, 3) == 6
    assert words_per_vector(128, 4) == 16
    assert words_per_vector(100, 2) == 8


def test_three_bit_group_uses_exactly_three_words():
    codes = torch.full((32,), 7, dtype=torch.uint8)
    words = pack_codes(codes, 3)
    assert words.shape == (3,)
    # 96 one-bits fill the three words completely: no padding inside a group.
    assert words.tolist() == [-1, -1, -1]


def test_hand_computed_three_bit_example():
    # Codes 1,2,...,7,0 repeated four times (32 codes). Eight 3-bit codes are
    # 24 bits; code i sits at stream bit 3i, so the first eight, read as octal
    # digits most-significant first, are 0o07654321 = 0b000_111_110_101_100_011_010_001
    # = 0x1F58D1. The 96-bit stream is that 24-bit chunk repeated four times:
    #     0x 1F58D1 1F58D1 1F58D1 1F58D1  (most significant first)
    # Cut into 32-bit words from the least significant end:
    #     word 0 = 0xD11F58D1   (code 10 straddles: its low 2 bits are bits 30-31)
    #     word 1 = 0x58D11F58   (code 21 straddles words 1 and 2)
    #     word 2 = 0x1F58D11F
    # As int32, word 0 has its top bit set: 0xD11F58D1 - 2**32 = -786474799.
    codes = torch.tensor([(i + 1) % 8 for i in range(32)], dtype=torch.uint8)
    expected = [0xD11F58D1 - 2**32, 0x58D11F58, 0x1F58D11F]
    assert pack_codes(codes, 3).tolist() == expected
    assert pack_codes_reference(codes, 3).tolist() == expected
    assert torch.equal(unpack_codes(torch.tensor(expected, dtype=torch.int32), 3, 32), codes)


def test_hand_computed_four_bit_example_with_padding():
    # 4-bit codes are nibbles, code 0 in the lowest: 1..8 -> 0x87654321. The
    # remaining 24 slots of the group are zero padding, so words 1..3 are 0.
    codes = torch.arange(1, 9, dtype=torch.uint8)
    assert pack_codes(codes, 4).tolist() == [0x87654321 - 2**32, 0, 0, 0]


def test_padding_of_final_group_is_zero():
    # 33 codes at 3 bits: the second group holds only code 32, in bits 0-2 of word 3.
    codes = torch.zeros(33, dtype=torch.uint8)
    codes[32] = 5
    assert pack_codes(codes, 3).tolist() == [0, 0, 0, 5, 0, 0]


def test_eight_bit_is_byte_layout():
    codes = torch.tensor([0x11, 0x22, 0x33, 0x44], dtype=torch.uint8)
    assert pack_codes(codes, 8)[0].item() == 0x44332211


def test_empty_tensors():
    for shape in [(0,), (0, 5), (4, 0), (2, 0, 7)]:
        codes = torch.zeros(shape, dtype=torch.uint8)
        words = pack_codes(codes, 3)
        assert words.shape == (*shape[:-1], words_per_vector(shape[-1], 3))
        assert torch.equal(unpack_codes(words, 3, shape[-1]), codes)


def test_non_contiguous_inputs():
    gen = torch.Generator().manual_seed(0)
    base = torch.randint(0, 8, (40, 6), generator=gen, dtype=torch.uint8)
    codes = base.t()[:, ::2]  # shape [6, 20], strided in both dims
    assert not codes.is_contiguous()
    words = pack_codes(codes, 3)
    assert torch.equal(words, pack_codes(codes.contiguous(), 3))

    wide = torch.stack([words, words], dim=-1)  # [6, 3, 2]
    strided_words = wide[..., 0]
    assert not strided_words.is_contiguous()
    assert torch.equal(unpack_codes(strided_words, 3, 20), codes)


@pytest.mark.parametrize("bits", [0, 9, -1, 3.0, True])
def test_bad_bits_raises(bits):
    with pytest.raises(ValueError, match="bits must be"):
        pack_codes(torch.zeros(4, dtype=torch.uint8), bits)
    with pytest.raises(ValueError, match="bits must be"):
        unpack_codes(torch.zeros(3, dtype=torch.int32), bits, 4)
    with pytest.raises(ValueError, match="bits must be"):
        words_per_vector(4, bits)


@pytest.mark.parametrize(
    "codes",
    [torch.tensor([0, 8, 1]), torch.tensor([0, -1, 1]), torch.tensor([300], dtype=torch.int16)],
)
def test_codes_out_of_range_raises(codes):
    with pytest.raises(ValueError, match=r"codes out of range for bits=3: expected values in \[0, 7\]"):
        pack_codes(codes, 3)
    with pytest.raises(ValueError, match="out of range"):
        pack_codes_reference(codes, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bool])
def test_non_integer_codes_raise(dtype):
    with pytest.raises(ValueError, match="integer dtype"):
        pack_codes(torch.zeros(4, dtype=dtype), 3)


def test_zero_dim_codes_raise():
    with pytest.raises(ValueError, match="at least one dimension"):
        pack_codes(torch.tensor(3, dtype=torch.uint8), 3)


def test_words_length_mismatch_raises():
    words = pack_codes(torch.zeros(33, dtype=torch.uint8), 3)  # 6 words
    with pytest.raises(ValueError, match=r"expected words_per_vector\(n=32, bits=3\) = 3"):
        unpack_codes(words, 3, 32)
    with pytest.raises(ValueError, match="last dimension is 6"):
        unpack_codes(words, 4, 33)
    with pytest.raises(ValueError, match="last dimension"):
        unpack_codes_reference(words, 3, 32)


def test_words_wrong_dtype_raises():
    with pytest.raises(ValueError, match="torch.int32"):
        unpack_codes(torch.zeros(3, dtype=torch.int64), 3, 32)


def test_negative_n_raises():
    with pytest.raises(ValueError, match="must be >= 0, got -1"):
        unpack_codes(torch.zeros(0, dtype=torch.int32), 3, -1)
    with pytest.raises(ValueError, match="must be >= 0"):
        words_per_vector(-5, 3)


# ---- a width per code -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 31, 64, 70, 192])
def test_mixed_widths_round_trip_and_equal_widths_are_pack_codes(n):
    from kvsqueeze.numerics.packing import code_offsets, mixed_words, pack_mixed, unpack_mixed

    g = torch.Generator().manual_seed(n)
    widths = torch.randint(1, 5, (n,), generator=g)
    offsets = code_offsets(widths)
    codes = (torch.rand(3, 2, n, generator=g) * 2.0**widths).floor().to(torch.uint8)
    words = pack_mixed(codes, offsets)
    assert words.dtype == torch.int32 and words.shape == (3, 2, mixed_words(offsets)) == (3, 2, -(-int(widths.sum()) // 32))
    assert torch.equal(unpack_mixed(words, offsets), codes)
    for bits in (1, 2, 3, 4):  # one width everywhere: the stream pack_codes writes (it pads to whole groups)
        same = codes % 2**bits
        mixed, even = pack_mixed(same, code_offsets(torch.full((n,), bits))), pack_codes(same, bits)
        assert torch.equal(mixed, even[..., : mixed.shape[-1]]) and not even[..., mixed.shape[-1]:].any()


def test_mixed_widths_refuse_codes_wider_than_their_channel_and_bad_widths():
    from kvsqueeze.numerics.packing import code_offsets, pack_mixed, unpack_mixed

    offsets = code_offsets(torch.tensor([1, 3, 2]))
    with pytest.raises(ValueError, match="wider than its channel"):
        pack_mixed(torch.tensor([[1, 7, 4]], dtype=torch.uint8), offsets)
    with pytest.raises(ValueError, match="per vector"):
        pack_mixed(torch.tensor([[1, 7]], dtype=torch.uint8), offsets)
    with pytest.raises(ValueError, match="code widths in 1..8"):
        code_offsets(torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="int32"):
        unpack_mixed(torch.zeros(1, 2, dtype=torch.int32), offsets)
