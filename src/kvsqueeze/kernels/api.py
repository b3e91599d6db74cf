"""Decode attention over the compressed KV cache: one op, a pure-torch reference and faster backends.

`decode_attention` attends one new query token per batch row to every cached
token of one layer, reading the cache in its compressed form (KVQuant, Hooper
et al., arXiv 2401.18079, Section 3.7): packed 2/3/4-bit key and value codes,
the per-layer codebooks, per-channel key and per-token value scales, sparse
fp16 outliers (CSC keys, CSR values) and fp16 attention sinks. Keys are stored
before RoPE and rotated at their own positions inside the op.

Backends compute the same thing (`Backend`): `reference` dequantizes the whole
cache with torch ops and runs plain softmax attention (the oracle, and the
fallback on any device); `numba` is the fused CPU kernel. `auto` takes the
fastest one available for the tensors' device.
"""

from __future__ import annotations

import enum
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .rope import Rope


class Outliers(NamedTuple):
    """Sparse exact values per slot (slot n = t * B + b): CSC of K^T for keys, CSR of V for values.

    pointers int32/int64 [T*B + 1], channels int16 [nnz] (16-bit pattern of a channel in [0, C)),
    values fp16 [nnz]. An outlier *replaces* the dequantized element at its channel. `fixed`: k when every slot
    holds exactly k entries (pointers[n] = n * k, as the cache stores value outliers); backends may then
    vectorize over slots. None: counts vary. `code`: the code every outlier's element holds in the packed codes
    (the store writes 0 there); backends may then take the element it replaces without reading the codes.
    None: any code.
    """

    pointers: torch.Tensor
    channels: torch.Tensor
    values: torch.Tensor
    fixed: int | None = None
    code: int | None = None

    @property
    def nnz(self) -> int:
        return self.values.numel()


@dataclass(frozen=True, eq=False)
class CompressedKV:
    """One layer's compressed cache as the kernels read it (views, nothing copied); T tokens, B rows.

    Attributes:
        heads, head_dim: KV heads H and their width D; C = H * D channels per token.
        k_codes, v_codes: int32 [T, B, W]: each slot's C codes packed along channels (`packing.py`).
        k_scale, k_zero: fp16 [C], offline per-channel key scale and zero-point.
        k_levels, v_levels: float32 [2**bits], the layer's codebooks; element = scale * level + zero.
        v_scale_zero: fp16 [T, B, 2], per-slot value scale and zero-point.
        k_outliers, v_outliers: `Outliers` or None.
        sink_k, sink_v: fp16 [B, S, C], exact pre-RoPE keys and values of each row's sinks.
        sink_slot: int32 [B, S], the token index t of each sink (-1: none); its slot's codes are ignored.
        positions: int32 [T, B], the RoPE position of every cached token.
    """

    heads: int
    head_dim: int
    k_bits: int
    v_bits: int
    k_codes: torch.Tensor
    v_codes: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    k_levels: torch.Tensor
    v_levels: torch.Tensor
    v_scale_zero: torch.Tensor
    k_outliers: Outliers | None
    v_outliers: Outliers | None
    sink_k: torch.Tensor
    sink_v: torch.Tensor
    sink_slot: torch.Tensor
    positions: torch.Tensor

    @property
    def tokens(self) -> int:
        return self.k_codes.shape[0]

    @property
    def batch(self) -> int:
        return self.k_codes.shape[1]

    @property
    def channels(self) -> int:
        return self.heads * self.head_dim

    @property
    def device(self) -> torch.device:
        return self.k_codes.device

    @classmethod
    def from_store(cls, store, positions: torch.Tensor, heads: int, head_dim: int) -> CompressedKV:
        """View a `kvsqueeze.cache.storage.QuantizedKV` (read through its public attributes).

        Args:
            store: the layer's `QuantizedKV`.
            positions: int32 [T, B] (the cache's `PositionLog` view, cut to the store's tokens).
            heads, head_dim: the layer's KV heads and head width.
        """
        def sparse(s) -> Outliers | None:
            if s is None:
                return None
            # fixed-count rows keep their pointers implicit; `pointer_view` materializes them
            return Outliers(s.pointer_view(), s.channels.view(), s.values.view(), s.fixed, store.OUTLIER_CODE)

        return cls(heads, head_dim, store.k_bits, store.v_bits, store.k_codes.view(), store.v_codes.view(),
                   store.k_scale, store.k_zero, store.kq.levels, store.vq.levels, store.v_scale_zero.view(),
                   sparse(store.k_outliers), sparse(store.v_outliers), store.sink_k, store.sink_v,
                   store.sink_slot, positions)


class Backend(str, enum.Enum):
    """Which implementation runs `decode_attention`."""

    AUTO = "auto"  # the fastest available for the tensors' device
    REFERENCE = "reference"  # pure torch, any device: dequantize everything, then softmax attention
    NUMBA = "numba"  # fused CPU kernel (numba, parallel)


# backend -> (module, whether it runs on a device type); modules are imported on first use
_MODULES = {Backend.NUMBA: ".numba_cpu", Backend.REFERENCE: ".reference"}
_DEVICES = {Backend.NUMBA: ("cpu",), Backend.REFERENCE: None}  # None: any device
_PREFERENCE = (Backend.NUMBA, Backend.REFERENCE)  # fastest first


@functools.cache
def _load(backend: Backend, entry: str = "decode_attention") -> Callable | None:
    """The backend module's function `entry` (None if the module cannot be imported or has none)."""
    try:
        return getattr(importlib.import_module(_MODULES[backend], __package__), entry, None)
    except ImportError:
        return None


def available_backends(device: torch.device | str = "cpu") -> list[Backend]:
    """Backends that can run on `device` in this environment, fastest first."""
    kind = torch.device(device).type
    return [b for b in _PREFERENCE if (_DEVICES[b] is None or kind in _DEVICES[b]) and _load(b) is not None]


def resolve_backend(backend: Backend | str, device: torch.device | str = "cpu") -> Backend:
    """The concrete backend `backend` means on `device` (raises if it cannot run there)."""
    try:
        backend = Backend(backend)
    except ValueError:
        raise ValueError(f"unknown backend {backend!r}; choose one of {[b.value for b in Backend]}") from None
    avail = available_backends(device)
    if backend is Backend.AUTO:
        return avail[0]
    if backend not in avail:
        raise ValueError(f"backend {backend.value!r} cannot run on {torch.device(device)} here "
                         f"(available: {[b.value for b in avail]}); the numba backend needs CPU tensors and numba")
    return backend


def _check(q: torch.Tensor, kv: CompressedKV, key_mask: torch.Tensor | None) -> None:
    b, hq, d = q.shape
    t = kv.tokens
    problems = []
    if q.dtype != torch.float32:
        problems.append(f"q must be float32, got {q.dtype}")
    if d != kv.head_dim or d % 2:
        problems.append(f"q head_dim {d} != cache head_dim {kv.head_dim} (must be even for RoPE)")
    if hq % kv.heads:
        problems.append(f"{hq} query heads are not a multiple of {kv.heads} KV heads")
    if b != kv.batch:
        problems.append(f"q has {b} rows, the cache {kv.batch}")
    if t == 0:
        problems.append("the cache is empty: append the new token before attending")
    if tuple(kv.positions.shape) != (t, b):
        problems.append(f"positions must be [T={t}, B={b}], got {tuple(kv.positions.shape)}")
    if key_mask is not None and (key_mask.dtype != torch.bool or tuple(key_mask.shape) != (b, t)):
        problems.append(f"key_mask must be bool [B={b}, T={t}], got {key_mask.dtype} {tuple(key_mask.shape)}")
    if problems:
        raise ValueError("decode_attention: " + "; ".join(problems))


def decode_attention(q: torch.Tensor, kv: CompressedKV, rope: Rope, scaling: float,
                     key_mask: torch.Tensor | None = None, backend: Backend | str = Backend.AUTO) -> torch.Tensor:
    """Attention of one new query token per row over a compressed cache.

    Args:
        q: float32 [B, Hq, D], RoPE already applied at the query's position; Hq = G * H (GQA groups of
            G query heads share KV head h = query head // G).
        kv: the layer's cache, the new token included (`CompressedKV`).
        rope: the model's rotary embedding, applied to each key at `kv.positions`.
        scaling: score multiplier (usually D ** -0.5).
        key_mask: bool [B, T], False where a row must not attend (padding, sliding window); None: all.
        backend: a `Backend` or its name.

    Returns:
        float32 [B, Hq, D].
    """
    _check(q, kv, key_mask)
    impl = _load(resolve_backend(backend, q.device))
    return impl(q.contiguous(), kv, rope, float(scaling), key_mask)


@functools.cache
def _resolved(backend: Backend | str, device_type: str) -> Backend:
    return resolve_backend(backend, device_type)


def decode_attention_store(q: torch.Tensor, store, positions, heads: int, head_dim: int, rope: Rope,
                           scaling: float, key_mask: torch.Tensor | None = None,
                           backend: Backend | str = Backend.AUTO) -> torch.Tensor:
    """`decode_attention` over a layer's `kvsqueeze.cache.storage.QuantizedKV`, read where it lies: the call a
    decode step of `generate()` makes.

    A backend that reads the store's buffers directly (numba) skips building `CompressedKV` views, whose
    Python-side cost is a sizeable part of a decode step when the caches are cold; every other backend, and
    any input the fast path would reject, goes through `CompressedKV.from_store` and `decode_attention`.

    Args:
        q, rope, scaling, key_mask, backend: as `decode_attention`.
        store: the layer's `QuantizedKV`, the new token included.
        positions: int32 [T', B] RoPE positions with T' >= the store's T tokens (rows past T are ignored):
            a tensor, or the cache's `PositionLog` (numpy views of it are kept between calls).
        heads, head_dim: the layer's KV heads and head width.

    Returns:
        float32 [B, Hq, D].
    """
    kind = _resolved(backend, q.device.type)
    fast = _load(kind, "decode_store")
    if fast is not None:
        out = fast(q, store, positions, heads, head_dim, rope, float(scaling), key_mask)
        if out is not None:
            return out
    pos = positions.view() if hasattr(positions, "array") else positions
    kv = CompressedKV.from_store(store, pos[: store.tokens], heads, head_dim)
    return decode_attention(q, kv, rope, scaling, key_mask, kind)
