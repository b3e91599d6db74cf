"""Decode attention over the compressed KV cache: one op, a pure-torch reference and faster backends.

`decode_attention` attends one new query token per batch row to every cached
token of one layer, reading the cache in its compressed form (KVQuant, Hooper
et al., arXiv 2401.18079, Section 3.7): packed 2/3/4-bit key and value codes,
the per-layer codebooks, per-channel key and per-token value scales, sparse
fp16 outliers (CSC keys, CSR values) and fp16 attention sinks, as a store's
`StoreView` holds them. Keys are stored before RoPE and rotated at their own
positions inside the op.

Backends compute the same thing (`Backend`): `reference` dequantizes the whole
cache with torch ops and runs plain softmax attention (the oracle; any
device); `numba` is the fused CPU kernel, `triton` the fused GPU kernels. A backend asked for by name raises
its own import error when it cannot load; `auto` takes the fastest one that
loads for the tensors' device, and warns once when it has to fall back.
"""

from __future__ import annotations

import enum
import functools
import importlib
import os
import warnings
from collections.abc import Callable

import torch

from ..numerics.rope import Rope
from .view import StoreView


class Backend(str, enum.Enum):
    """Which implementation runs `decode_attention`."""

    AUTO = "auto"  # the fastest available for the tensors' device
    REFERENCE = "reference"  # pure torch, any device: dequantize everything, then softmax attention
    NUMBA = "numba"  # fused CPU kernel (numba, parallel)
    TRITON = "triton"  # fused GPU kernels (Triton); on CPU tensors only under TRITON_INTERPRET=1


_MODULES = {Backend.NUMBA: ".numba", Backend.TRITON: ".triton", Backend.REFERENCE: ".reference"}  # imported on use
_PREFERENCE = (Backend.NUMBA, Backend.TRITON, Backend.REFERENCE)  # fastest first, for each device


def _devices(backend: Backend) -> tuple[str, ...] | None:
    """Device types a backend runs on (None: any). Triton's interpreter runs its programs on CPU tensors."""
    if backend is Backend.NUMBA:
        return ("cpu",)
    if backend is Backend.TRITON:
        return ("cuda", "cpu") if os.environ.get("TRITON_INTERPRET") == "1" else ("cuda",)
    return None


@functools.cache
def _load(backend: Backend) -> Callable:
    """The backend's `decode_attention`; a module that cannot be imported raises its own error."""
    return importlib.import_module(_MODULES[backend], __package__).decode_attention


@functools.cache
def _dequantizer(device_type: str) -> Callable:
    """The fastest `dequantize_view` that loads for a device type: numba's on the CPU, else the reference's."""
    backend = resolve_backend(Backend.AUTO, device_type)
    module = importlib.import_module(_MODULES[backend], __package__)
    return getattr(module, "dequantize_view", None) or importlib.import_module(".reference", __package__).dequantize_view


def _runs_on(backend: Backend, device_type: str) -> bool:
    return _devices(backend) is None or device_type in _devices(backend)


def _loads(backend: Backend) -> bool:
    try:
        _load(backend)
    except ImportError:
        return False
    return True


def _candidates(device_type: str) -> list[Backend]:
    """What `auto` may take on a device type, fastest first: Triton's interpreter (CPU tensors) only when asked
    for by name, since it runs every program in Python."""
    return [b for b in _PREFERENCE if _runs_on(b, device_type) and (b is not Backend.TRITON or device_type == "cuda")]


def available_backends(device: torch.device | str = "cpu") -> list[Backend]:
    """Backends `auto` can take on `device` in this environment, fastest first."""
    return [b for b in _candidates(torch.device(device).type) if _loads(b)]


@functools.cache
def _warn_fallback(backend: Backend, device_type: str) -> None:
    try:
        _load(backend)
    except ImportError as exc:
        warnings.warn(f"the {backend.value} decode backend cannot be loaded ({exc}); backend='auto' runs the "
                      f"next one on {device_type}, which is much slower. Ask for backend='{backend.value}' to "
                      "see the full error", RuntimeWarning, stacklevel=4)


def resolve_backend(backend: Backend | str, device: torch.device | str = "cpu") -> Backend:
    """The concrete backend `backend` means on `device`.

    Raises:
        ValueError: an unknown name, or a backend that does not run on that device.
        ImportError: a backend asked for by name whose module cannot be loaded (its own error).
    """
    try:
        backend = Backend(backend)
    except ValueError:
        raise ValueError(f"unknown backend {backend!r}; choose one of {[b.value for b in Backend]}") from None
    kind = torch.device(device).type
    if backend is Backend.AUTO:
        for b in _candidates(kind):
            if _loads(b):
                return b
            _warn_fallback(b, kind)
        raise RuntimeError(f"no decode backend runs on {kind}")  # unreachable: the reference runs anywhere
    if not _runs_on(backend, kind):
        raise ValueError(f"backend {backend.value!r} cannot run on {torch.device(device)} "
                         f"(it runs on {', '.join(_devices(backend))}); use backend='auto' or 'reference'")
    _load(backend)
    return backend


@functools.cache
def _entry(backend: Backend | str, device_type: str) -> Callable:
    return _load(resolve_backend(backend, device_type))


def _check(q: torch.Tensor, kv: StoreView, rope: Rope, key_mask: torch.Tensor | None) -> None:
    """Raise one ValueError listing every problem of the inputs."""
    b, hq, d = q.shape
    t = kv.tokens
    pos = kv.positions.shape
    if (q.dtype == torch.float32 and d == kv.head_dim and not d % 2 and not hq % kv.heads and b == kv.batch
            and t > 0 and len(pos) == 2 and pos[0] >= t and pos[1] == b
            and 0 < 2 * rope.half <= d
            and (key_mask is None or (key_mask.dtype == torch.bool and key_mask.shape == (b, t)))):
        return  # every decode step passes here: the messages below are built only for a bad input
    problems = []
    if q.dtype != torch.float32:
        problems.append(f"q must be float32, got {q.dtype}")
    if d != kv.head_dim or d % 2:
        problems.append(f"q head_dim {d} != cache head_dim {kv.head_dim} (must be even for RoPE)")
    if hq % kv.heads:
        problems.append(f"{hq} query heads are not a multiple of {kv.heads} KV heads")
    if not 0 < 2 * rope.half <= d:
        problems.append(f"the RoPE frequencies turn {2 * rope.half} channels, the heads have {d}")
    if b != kv.batch:
        problems.append(f"q has {b} rows, the cache {kv.batch}")
    if t == 0:
        problems.append("the cache is empty: append the new token before attending")
    if kv.positions.dim() != 2 or kv.positions.shape[0] < t or kv.positions.shape[1] != b:
        problems.append(f"positions must be [T={t} or more, B={b}], got {tuple(kv.positions.shape)}")
    if key_mask is not None and (key_mask.dtype != torch.bool or tuple(key_mask.shape) != (b, t)):
        problems.append(f"key_mask must be bool [B={b}, T={t}], got {key_mask.dtype} {tuple(key_mask.shape)}")
    if problems:
        raise ValueError("decode_attention: " + "; ".join(problems))


def decode_attention(q: torch.Tensor, kv: StoreView, rope: Rope, scaling: float,
                     key_mask: torch.Tensor | None = None, backend: Backend | str = Backend.AUTO,
                     softcap: float | None = None, sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new query token per row over a compressed cache.

    Args:
        q: float32 [B, Hq, D], RoPE already applied at the query's position; Hq = G * H (GQA groups of
            G query heads share KV head h = query head // G).
        kv: the layer's cache, the new token included (`KVStore.view()`).
        rope: the model's rotary embedding, applied to each key at `kv.positions`.
        scaling: score multiplier (usually D ** -0.5).
        key_mask: bool [B, T], False where a row must not attend (padding, sliding window); None: all.
        backend: a `Backend` or its name.
        softcap: scores become softcap * tanh(score / softcap) before the mask (Gemma-2); None: not capped.
        sink_logits: [Hq], a learned logit per query head that joins the softmax with no value (GPT-OSS).

    Returns:
        float32 [B, Hq, D].
    """
    impl = _entry(backend, q.device.type)
    _check(q, kv, rope, key_mask)
    if sink_logits is not None and sink_logits.numel() != q.shape[1]:
        raise ValueError(f"decode_attention: sink_logits must hold one logit per query head ({q.shape[1]}), "
                         f"got {tuple(sink_logits.shape)}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"decode_attention: softcap must be positive (None: no cap), got {softcap}")
    return impl(q.contiguous(), kv, rope, float(scaling), key_mask, softcap, sink_logits)


def dequantize_view(kv: StoreView) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys (pre-RoPE) and values of every slot of a compressed cache, float32 [T, B, C] each, as
    `kernels.reference.dequantize_view` reconstructs them (level[code] * scale + zero, outliers in place, sinks
    whole), by the fastest backend that has this op for the view's device: numba's compiled pass on the CPU
    (equal to the reference bit for bit, which the tests hold it to), the reference elsewhere."""
    return _dequantizer(kv.device.type)(kv)
