"""The "kvsqueeze" attention function, registered in transformers' attention registry.

It asks each registered handler in turn (`register_handler`): `fused.py` takes
decode steps whose cache layer returned a fused-decode marker and runs the
kernel over the compressed cache; `kivi.py` takes modules tagged for KIVI's
mixed fp16-window / quantized attention. Whatever no handler takes falls
through to transformers' SDPA attention, so selecting this implementation
changes nothing for a model without kvsqueeze state.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .parts import attention_modules
from .preflight import UnsupportedModelError

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


# handler(module, query, key, value, attention_mask, scaling, **kwargs) -> (output, weights), or None to pass
_HANDLERS: list[Callable] = []
# attention options a handler cannot honour: logit soft-capping (Gemma-2), learned sink logits (GPT-OSS)
UNSUPPORTED_OPTIONS = ("softcap", "s_aux")


def refuse_options(what: str, module, kwargs: dict) -> None:
    """Raise a clear error when the model asks `what` for an attention option it does not implement."""
    used = [k for k in UNSUPPORTED_OPTIONS if kwargs.get(k) is not None]
    if used:
        raise UnsupportedModelError(
            f"layer {getattr(module, 'layer_idx', '?')} of {type(module).__name__} asks attention for "
            f"{', '.join(used)}, which {what} does not implement; attend densely (no fused decode) with the "
            "model's own attention implementation, or use a method without it")


def refuse_model_options(what: str, model) -> None:
    """The same refusal before any work, from the model itself: soft-capped logits or learned sink logits."""
    found = []
    if getattr(model.config, "attn_logit_softcapping", None) is not None:
        found.append("softcap (attn_logit_softcapping)")
    if any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in attention_modules(model)):
        found.append("s_aux (learned sink logits)")
    if found:
        raise UnsupportedModelError(
            f"{type(model).__name__} asks attention for {', '.join(found)}, which {what} does not implement; "
            "attend densely (no fused decode) with the model's own attention implementation, or use a method "
            "without it")


def register_handler(handler: Callable) -> None:
    """Add an attention handler (idempotent); handlers are asked in the order they were registered."""
    if handler not in _HANDLERS:
        _HANDLERS.append(handler)


def kvsqueeze_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention dispatch: the first registered handler that takes the call, or SDPA."""
    for handler in _HANDLERS:
        out = handler(module, query, key, value, attention_mask, scaling, **kwargs)
        if out is not None:
            return out
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def register_attention() -> None:
    """Register the "kvsqueeze" attention and its mask builder (idempotent)."""
    AttentionInterface.register(ATTN_NAME, kvsqueeze_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
