"""KIVI (Liu et al., ICML 2024) simulated: keys per channel over groups of tokens, values per token
over groups of channels, both post-RoPE, and the most recent `window` tokens kept in fp16.

Which tokens are in the fp16 window depends on the query, so this runs inside
attention: for query position i, key j is read in full precision when
i - j < window and quantized otherwise. A key group of G tokens is complete
before any of its tokens leaves the window (window >= G), so no statistic uses
a future token.
"""

from __future__ import annotations

import torch

from ..datatypes import uniform_levels
from ..methods import MethodSpec
from ..quantizer import choose_qparams, dequantize, quantize
from .attention import causal_bool_mask


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


def kivi_attention(module, query, key, value, attention_mask, scaling, spec: MethodSpec):
    """Attention over [B, H, T, D] tensors where old tokens are KIVI-quantized and recent ones exact.

    The mixed softmax is one SDPA call over 2T keys: the quantized copy of every
    token, visible to queries at least `window` positions later, followed by the
    exact copy, visible to the others (the causal mask applies to both).
    """
    tq, tk = query.shape[2], key.shape[2]
    kq = fake_quantize_token_groups(key, spec.group_size, spec.k_bits)
    vq = fake_quantize_channel_groups(value, spec.group_size, spec.v_bits)
    qpos = torch.arange(tk - tq, tk, device=query.device)
    recent = (qpos[:, None] - torch.arange(tk, device=query.device)[None, :]) < spec.window  # [Tq, Tk]
    causal = causal_bool_mask(attention_mask, tq, tk, query.device)  # [B|1, 1, Tq, Tk]
    mask = torch.cat([causal & ~recent, causal & recent], dim=-1)  # [B|1, 1, Tq, 2 Tk]
    keys = torch.cat([kq, key], dim=2)
    values = torch.cat([vq, value], dim=2)
    gqa = query.shape[1] != key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None
