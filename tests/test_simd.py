"""Tests for kvsqueeze.kernels.simd: the vector primitives the numba kernels are built from."""

from __future__ import annotations

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from kvsqueeze.kernels.simd import LANES, vexp, vfunnel, vload, vlookup, vstore  # noqa: E402


@numba.njit(cache=False)
def _exp_all(x, out):
    for k in range(0, x.shape[0], LANES):
        vstore(out, k, vexp(vload(x, k)))


@numba.njit(cache=False)
def _lookup_all(table, idx, out):
    for k in range(0, idx.shape[0], LANES):
        vstore(out, k, vlookup(vload(table, 0), vload(idx, k)))


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


def test_vlookup_reads_only_the_low_four_bits():
    table = np.arange(LANES, dtype=np.float32) * 1.5 - 3
    idx = np.random.default_rng(0).integers(0, 2**32, 4 * LANES, dtype=np.uint64).astype(np.uint32)
    out = np.empty(idx.shape[0], np.float32)
    _lookup_all(table, idx, out)
    assert np.array_equal(out, table[idx & 15])


@pytest.mark.parametrize("shift", [0, 1, 7, 29, 31])
def test_vfunnel_takes_32_bits_of_the_word_pair(shift):
    rng = np.random.default_rng(shift)
    lo, hi = (rng.integers(0, 2**32, 2 * LANES, dtype=np.uint64).astype(np.uint32) for _ in range(2))
    out = np.empty_like(lo)
    _funnel_all(lo, hi, shift, out)
    pair = lo.astype(np.uint64) | (hi.astype(np.uint64) << np.uint64(32))
    assert np.array_equal(out, ((pair >> np.uint64(shift)) & np.uint64(0xFFFFFFFF)).astype(np.uint32))
