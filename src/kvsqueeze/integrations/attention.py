"""The "kvsqueeze" attention function, registered in transformers' attention registry.

Modules without kvsqueeze state fall through to transformers' SDPA attention,
so registering it changes nothing for them. A module tagged with
`kvsqueeze_fused` (see `fused.py`) whose decode step received a fused-decode
marker from its cache layer runs the fused kernel over the compressed cache;
a module tagged with `kvsqueeze_kivi` runs KIVI's mixed fp16-window /
quantized attention.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTN_NAME = "kvsqueeze"


def causal_bool_mask(attention_mask, q_len: int, k_len: int, device) -> torch.Tensor:
    """Bool mask [B or 1, 1, q_len, k_len] (True = attend) from whatever the mask interface produced."""
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        return attention_mask[..., -k_len:]
    qpos = torch.arange(k_len - q_len, k_len, device=device)
    mask = (torch.arange(k_len, device=device)[None, :] <= qpos[:, None])[None, None]
    if attention_mask is not None:  # additive float mask
        mask = mask & (attention_mask[..., -k_len:] > torch.finfo(attention_mask.dtype).min / 2)
    return mask


def kvsqueeze_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention dispatch: fused decode over the compressed cache, KIVI simulation, or SDPA."""
    if getattr(module, "kvsqueeze_fused", None) is not None:
        from .fused import fused_decode_attention, fused_layer_of

        layer = fused_layer_of(key)
        if layer is not None:  # a decode step (query length 1) of a FusedDecodeLayer
            return fused_decode_attention(layer, query, attention_mask, scaling)
    spec = getattr(module, "kvsqueeze_kivi", None)
    if spec is not None:
        from .kivi import kivi_attention

        return kivi_attention(module, query, key, value, attention_mask, scaling, spec)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def register_attention() -> None:
    """Register the "kvsqueeze" attention and its mask builder (idempotent)."""
    AttentionInterface.register(ATTN_NAME, kvsqueeze_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
