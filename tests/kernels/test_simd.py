"""Tests for kvsqueeze.kernels.simd: the vector primitives the numba kernels are built from."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import llvmlite.binding
import numba
import numpy as np
import pytest

from kvsqueeze.kernels.numba import simd
from kvsqueeze.kernels.numba.simd import (
    LANES,
    uadd,
    uand,
    ulanes,
    umin,
    umul,
    ushr,
    vexp,
    vfunnel,
    vhalf,
    vindex,
    vindex16,
    vload,
    vlookup,
    vlookup8,
    vpick,
    vscatter,
    vstore,
)


@numba.njit(cache=False)
def _exp_all(x, out):
    for k in range(0, x.shape[0], LANES):
        vstore(out, k, vexp(vload(x, k)))


@numba.njit(cache=False)
def _lookup_all(table, idx, out):
    for k in range(0, idx.shape[0], LANES):
        vstore(out, k, vlookup(vload(table, 0), vload(idx, k)))


@numba.njit(cache=False)
def _lookup8_all(table, idx, out):
    for k in range(0, idx.shape[0], LANES):
        vstore(out, k, vlookup8(vload(table, 0), vload(idx, k)))


@numba.njit(cache=False)
def _pick_all(a, b, idx, bit, out):
    for k in range(0, idx.shape[0], LANES):
        vstore(out, k, vpick(vload(a, k), vload(b, k), vload(idx, k), bit))


@numba.njit(cache=False)
def _funnel_all(lo, hi, shift, out):
    for k in range(0, lo.shape[0], LANES):
        vstore(out, k, vfunnel(vload(lo, k), vload(hi, k), shift))


def test_vexp_is_accurate_to_a_few_ulp():
    x = np.linspace(-87.0, 88.0, 160_000, dtype=np.float32)
    out = np.empty_like(x)
    _exp_all(x, out)
    ref = np.exp(x.astype(np.float64))
    rel = np.abs(out - ref) / ref
    assert rel.max() < 4 * np.finfo(np.float32).eps, float(rel.max())


def test_vexp_underflows_to_zero_and_keeps_nan():
    x = np.full(LANES, -1.0, np.float32)
    x[:4] = [-np.inf, -88.0, -1000.0, np.nan]
    out = np.empty_like(x)
    _exp_all(x, out)
    assert out[0] == 0 and out[1] == 0 and out[2] == 0
    assert np.isnan(out[3])
    assert np.allclose(out[4:], np.exp(-1.0), rtol=1e-6)


def test_the_kernels_compile_for_the_instruction_set_of_the_target():
    """The host's own, unless the environment names another (the AVX2 run on an AVX-512 host, below): the
    module's choice, and the registers of the machine code a kernel compiled to (zmm: AVX-512; ymm and no zmm:
    AVX2)."""
    expect = os.environ.get("KVSQUEEZE_EXPECT_ISA")
    if expect is None:
        host = {k for k, on in llvmlite.binding.get_host_cpu_features().items() if on}
        expect = "avx512" if "avx512f" in host else "avx2" if "avx2" in host else "generic"
    assert simd.ISA == expect
    x = np.zeros(LANES, np.float32)
    _exp_all(x, np.empty_like(x))
    asm = "".join(_exp_all.inspect_asm().values())
    if expect == "avx512":
        assert "%zmm" in asm
    elif expect == "avx2":
        assert "%ymm" in asm and "%zmm" not in asm


@pytest.mark.skipif(simd.ISA != "avx512", reason="an AVX2 host runs the AVX2 path in every kernel test already")
def test_the_avx2_path_on_an_avx512_host():
    """Either machine tests both lookups: an AVX-512 host compiles the kernels for AVX2 in a second process and
    holds them to the reference there."""
    env = {**os.environ, **simd.AVX2_ENV, "KVSQUEEZE_EXPECT_ISA": "avx2"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                          "tests/kernels/test_simd.py", "tests/kernels/test_decode.py", "-k",
                          "numba or vlookup or instruction_set"], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def test_vlookup_reads_only_the_low_four_bits():
    table = np.arange(LANES, dtype=np.float32) * 1.5 - 3
    idx = np.random.default_rng(0).integers(0, 2**32, 4 * LANES, dtype=np.uint64).astype(np.uint32)
    out = np.empty(idx.shape[0], np.float32)
    _lookup_all(table, idx, out)
    assert np.array_equal(out, table[idx & 15])


@pytest.mark.parametrize("bit", [16, 32, 1 << 31])
def test_vpick_takes_b_where_the_index_has_the_bit(bit):
    """The blend the kernels read 32- and 64-level rows with: b where `index & bit` is set, a elsewhere, whatever
    the other bits."""
    rng = np.random.default_rng(bit % 97)
    a, b = rng.standard_normal((2, 4 * LANES)).astype(np.float32)
    idx = rng.integers(0, 2**32, 4 * LANES, dtype=np.uint64).astype(np.uint32)
    out = np.empty_like(a)
    _pick_all(a, b, idx, bit, out)
    assert np.array_equal(out, np.where(idx & np.uint32(bit), b, a))
    assert 0 < int(np.count_nonzero(idx & np.uint32(bit))) < idx.shape[0]  # both sides taken


@pytest.mark.parametrize("period", [1, 2, 4, 8])
def test_vlookup8_reads_only_the_low_three_bits_of_tables_of_period_dividing_8(period):
    """The narrow lookup of codes up to 3 bits wide: on tables that repeat every `period` entries (as the kernels'
    rows of such codes do) it equals both table[idx & 7] and the 16-entry lookup, whatever the bits above."""
    levels = np.random.default_rng(period).standard_normal(period).astype(np.float32)
    table = np.tile(levels, LANES // period)
    idx = np.random.default_rng(1).integers(0, 2**32, 4 * LANES, dtype=np.uint64).astype(np.uint32)
    out, wide = np.empty(idx.shape[0], np.float32), np.empty(idx.shape[0], np.float32)
    _lookup8_all(table, idx, out)
    _lookup_all(table, idx, wide)
    assert np.array_equal(out, table[idx & 7])
    assert np.array_equal(out, wide)


@pytest.mark.parametrize("shift", [0, 1, 7, 29, 31])
def test_vfunnel_takes_32_bits_of_the_word_pair(shift):
    rng = np.random.default_rng(shift)
    lo, hi = (rng.integers(0, 2**32, 2 * LANES, dtype=np.uint64).astype(np.uint32) for _ in range(2))
    out = np.empty_like(lo)
    _funnel_all(lo, hi, shift, out)
    pair = lo.astype(np.uint64) | (hi.astype(np.uint64) << np.uint64(32))
    assert np.array_equal(out, ((pair >> np.uint64(shift)) & np.uint64(0xFFFFFFFF)).astype(np.uint32))


@numba.njit(cache=False)
def _funnel_lanes(lo, hi, shift, out):
    vstore(out, 0, vfunnel(vload(lo, 0), vload(hi, 0), vload(shift, 0)))


def test_vfunnel_takes_a_shift_per_lane():
    rng = np.random.default_rng(7)
    lo, hi = (rng.integers(0, 2**32, LANES, dtype=np.uint64).astype(np.uint32) for _ in range(2))
    shift = rng.integers(0, 32, LANES).astype(np.uint32)
    out = np.empty_like(lo)
    _funnel_lanes(lo, hi, shift, out)
    pair = lo.astype(np.uint64) | (hi.astype(np.uint64) << np.uint64(32))
    assert np.array_equal(out, ((pair >> shift.astype(np.uint64)) & np.uint64(0xFFFFFFFF)).astype(np.uint32))


@numba.njit(cache=False)
def _index16(arr, base, offsets, valid, out):
    vstore(out, 0, vindex16(arr, base, vload(offsets, 0), valid))


@pytest.mark.parametrize("valid", [16, 5, 0])
def test_vindex16_reads_halfwords_at_lane_offsets_and_zeroes_the_rest(valid):
    rng = np.random.default_rng(valid)
    arr = rng.integers(0, 2**16, 300, dtype=np.uint64).astype(np.uint16)
    offsets = rng.permutation(290)[:LANES].astype(np.uint32)  # any order, as rows of pages come
    out = np.empty(LANES, np.uint32)
    _index16(arr, 7, offsets, valid, out)
    want = np.zeros(LANES, np.uint32)
    want[:valid] = arr[7 + offsets[:valid]]
    assert np.array_equal(out, want)


@numba.njit(cache=False)
def _halves(bits, out):
    vstore(out, 0, vhalf(vload(bits, 0)))


def test_vhalf_converts_the_low_16_bits_exactly():
    vals = np.array([0, -0.0, 1, -2.5, 65504, 6e-8, np.inf, -np.inf, 3.14, 1e-4, -7, 0.5, 2**-14, 100, 1e3, -1e-3],
                    np.float16)
    bits = vals.view(np.uint16).astype(np.uint32) | np.uint32(0xABCD0000)  # high bits are ignored
    out = np.empty(LANES, np.float32)
    _halves(bits, out)
    assert np.array_equal(out, vals.astype(np.float32))


@numba.njit(cache=False)
def _index_scatter(src, dst, base, offsets, valid, out):
    got = vindex(src, base, vload(offsets, 0), valid)
    vstore(out, 0, got)
    vscatter(dst, base, vload(offsets, 0), got, valid)


@pytest.mark.parametrize("valid", [16, 9, 0])
def test_vindex_gathers_and_vscatter_writes_lanes_at_offsets(valid):
    rng = np.random.default_rng(valid)
    src = rng.standard_normal(300).astype(np.float32)
    offsets = rng.permutation(290)[:LANES].astype(np.uint32)
    dst, out = np.zeros_like(src), np.empty(LANES, np.float32)
    _index_scatter(src, dst, 5, offsets, valid, out)
    want = np.zeros(LANES, np.float32)
    want[:valid] = src[5 + offsets[:valid]]
    assert np.array_equal(out, want)
    written = np.zeros_like(src)
    written[5 + offsets[:valid]] = src[5 + offsets[:valid]]
    assert np.array_equal(dst, written)


@numba.njit(cache=False)
def _uint_ops(a, b, out):
    x, y = vload(a, 0), vload(b, 0)
    vstore(out, 0, uadd(x, y))
    vstore(out, LANES, umul(x, 3))
    vstore(out, 2 * LANES, ushr(x, 5))
    vstore(out, 3 * LANES, uand(x, y))
    vstore(out, 4 * LANES, umin(x, y))
    vstore(out, 5 * LANES, ulanes())


def test_uint_lanes_wrap_modulo_2_32():
    rng = np.random.default_rng(3)
    a, b = (rng.integers(0, 2**32, LANES, dtype=np.uint64).astype(np.uint32) for _ in range(2))
    out = np.empty(6 * LANES, np.uint32)
    _uint_ops(a, b, out)
    wide = a.astype(np.uint64)
    for got, want in zip(out.reshape(6, LANES), [(wide + b) % 2**32, (wide * 3) % 2**32, a >> 5, a & b,
                                                  np.minimum(a, b), np.arange(LANES)]):
        assert np.array_equal(got, np.asarray(want).astype(np.uint32))
