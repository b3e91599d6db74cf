"""KIVI (Liu et al., ICML 2024) simulated: keys per channel over groups of tokens, values per token
over groups of channels, both post-RoPE, and the most recent `window` tokens kept in fp16.

Which tokens are in the fp16 window depends on the query, so this runs inside
attention: for query position i, key j is read in full precision when
i - j < window and quantized otherwise. A key group of G tokens is complete
before any of its tokens leaves the window (window >= G), so no statistic uses
a future token.
"""

from __future__ import annotations

import weakref

import torch

from ..numerics.affine import choose_qparams, dequantize, quantize
from ..numerics.datatypes import uniform_levels
from ..methods import MethodSpec
from ..kernels.mixed import mixed_attention


def fake_quantize_token_groups(k: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """Per-channel uniform quantization of k [B, H, T, D] over consecutive groups of `group` tokens."""
    b, h, t, d = k.shape
    pad = -t % group
    kp = torch.cat([k, k[:, :, -1:].expand(b, h, pad, d)], dim=2) if pad else k
    kg = kp.float().view(b, h, -1, group, d)
    scale, zero = choose_qparams(kg.amin(3, keepdim=True), kg.amax(3, keepdim=True))
    levels = uniform_levels(bits)
    out = dequantize(quantize(kg, scale, zero, levels), scale, zero, levels)
    return out.view(b, h, -1, d)[:, :, :t].to(k.dtype)


def fake_quantize_channel_groups(v: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """Per-token uniform quantization of v [B, H, T, D] over groups of `group` channels (across heads)."""
    b, h, t, d = v.shape
    flat = v.transpose(1, 2).reshape(b, t, h * d)
    c = h * d
    pad = -c % group
    fp = torch.cat([flat, flat[..., -1:].expand(b, t, pad)], dim=-1) if pad else flat
    fg = fp.float().view(b, t, -1, group)
    scale, zero = choose_qparams(fg.amin(-1, keepdim=True), fg.amax(-1, keepdim=True))
    levels = uniform_levels(bits)
    out = dequantize(quantize(fg, scale, zero, levels), scale, zero, levels).view(b, t, -1)[..., :c]
    return out.view(b, t, h, d).transpose(1, 2).to(v.dtype)


class _Quantized:
    """The last keys and values an attention module saw, and their KIVI-quantized copies."""

    def __init__(self, key, value, kq, vq):
        self.key, self.value, self.kq, self.vq = key, value, kq, vq


_MEMO: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # attention module -> _Quantized


def _reusable(memo: _Quantized | None, key: torch.Tensor, value: torch.Tensor, group: int) -> int:
    """How many leading tokens' quantized copies `memo` holds for these keys and values (whole key groups)."""
    if memo is None or memo.key.shape[:2] != key.shape[:2] or memo.key.dtype != key.dtype:
        return 0
    n = min(memo.key.shape[2], key.shape[2]) // group * group
    if n == 0 or memo.key.device != key.device:
        return 0
    if torch.equal(memo.key[:, :, :n], key[:, :, :n]) and torch.equal(memo.value[:, :, :n], value[:, :, :n]):
        return n
    return 0


def quantized_kv(module, key: torch.Tensor, value: torch.Tensor, spec: MethodSpec):
    """KIVI's quantized copies of key and value [B, H, T, D], reusing what this module quantized last time.

    A key group's quantization reads only its own `group_size` tokens and a value's only its own token, so the
    copies of a prefix that has not changed (compared exactly) stay valid: a decode step quantizes the new
    tokens and the last, partial key group only. Without a module (None) everything is quantized.
    """
    g = spec.group_size
    memo = _MEMO.get(module) if module is not None else None
    n = _reusable(memo, key, value, g)
    if n == key.shape[2]:
        kq, vq = memo.kq[:, :, :n], memo.vq[:, :, :n]
    else:
        kq = fake_quantize_token_groups(key[:, :, n:], g, spec.k_bits)
        vq = fake_quantize_channel_groups(value[:, :, n:], g, spec.v_bits)
        if n:
            kq = torch.cat([memo.kq[:, :, :n], kq], dim=2)
            vq = torch.cat([memo.vq[:, :, :n], vq], dim=2)
    if module is not None:
        _MEMO[module] = _Quantized(key, value, kq, vq)
    return kq, vq


def forget(modules) -> None:
    """Drop what these attention modules remember (the simulation of a KIVI method ended)."""
    for m in modules:
        _MEMO.pop(m, None)


def kivi_attention(module, query, key, value, attention_mask, scaling, spec: MethodSpec,
                   chunk: int | None = None, softcap: float | None = None, sink_logits=None):
    """Attention over [B, H, T, D] tensors where old tokens are KIVI-quantized and recent ones exact."""
    kq, vq = quantized_kv(module, key, value, spec)
    return mixed_attention(query, key, value, kq, vq, attention_mask, scaling, spec.window, chunk, softcap,
                           sink_logits)


def kivi_handler(module, query, key, value, attention_mask, scaling, **kwargs):
    """The "kvsqueeze" attention handler for modules tagged with a KIVI method (`kvsqueeze_kivi`)."""
    spec = getattr(module, "kvsqueeze_kivi", None)
    if spec is None:
        return None
    return kivi_attention(module, query, key, value, attention_mask, scaling, spec,
                          softcap=kwargs.get("softcap"), sink_logits=kwargs.get("s_aux"))

