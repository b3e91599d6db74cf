"""kvsqueeze's attention functions, registered in transformers' attention registry.

They ask each registered handler in turn (`register_handler`): `fused.py` takes
decode steps whose cache layer returned a fused-decode marker and runs the
kernel over the compressed cache; `kivi.py` takes modules tagged for KIVI's
mixed fp16-window / quantized attention. Whatever no handler takes falls
through to the attention the model had: "kvsqueeze" over transformers' SDPA,
"kvsqueeze_eager" over the model family's own eager attention (what models
that soft-cap their logits, Gemma-2, or add learned sink logits, GPT-OSS, run
on), each with the mask its fallback expects. `switch_attention` picks the one
that matches the model, so selecting it changes nothing for a model without
kvsqueeze state. Handlers honour the options the model passes: `scaling`,
`softcap` (Gemma-2), `s_aux` (GPT-OSS), and sliding windows through the mask.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from .preflight import UnsupportedModelError

ATTN_NAME = "kvsqueeze"  # falls through to SDPA
EAGER_NAME = "kvsqueeze_eager"  # falls through to the model family's eager attention


# handler(module, query, key, value, attention_mask, scaling, **kwargs) -> (output, weights), or None to pass
_HANDLERS: list[Callable] = []


def register_handler(handler: Callable) -> None:
    """Add an attention handler (idempotent); handlers are asked in the order they were registered."""
    if handler not in _HANDLERS:
        _HANDLERS.append(handler)


def _dispatcher(fallback: Callable, doc: str) -> Callable:
    """An attention function: the first registered handler that takes the call, else `fallback(module)`'s."""

    def kvsqueeze_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        for handler in _HANDLERS:
            out = handler(module, query, key, value, attention_mask, scaling, **kwargs)
            if out is not None:
                return out
        return fallback(module)(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                **kwargs)

    kvsqueeze_attention.__doc__ = doc
    return kvsqueeze_attention


def family_eager(module) -> Callable:
    """The `eager_attention_forward` of the modeling file that defines `module`'s class."""
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise UnsupportedModelError(f"{type(module).__name__} runs eager attention, but its modeling module "
                                    f"{type(module).__module__} has no `eager_attention_forward` to fall back on; "
                                    "load the model with attn_implementation='sdpa'")
    return eager


kvsqueeze_attention = _dispatcher(lambda module: sdpa_attention_forward,
                                  "Attention dispatch: the first registered handler that takes the call, or SDPA.")
kvsqueeze_eager_attention = _dispatcher(family_eager, "Attention dispatch: the first registered handler that "
                                        "takes the call, or the family's eager attention.")


def register_attention() -> None:
    """Register both attention functions and their mask builders (idempotent)."""
    AttentionInterface.register(ATTN_NAME, kvsqueeze_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    AttentionInterface.register(EAGER_NAME, kvsqueeze_eager_attention)
    AttentionMaskInterface.register(EAGER_NAME, eager_mask)


def switch_attention(model) -> str:
    """Switch `model` to the kvsqueeze attention over its own; returns the implementation to restore later."""
    saved = model.config._attn_implementation
    if saved in (ATTN_NAME, EAGER_NAME):
        return saved  # already switched (another kvsqueeze user): restored to that
    if saved not in ("sdpa", "eager"):
        raise UnsupportedModelError(f"{type(model).__name__} runs attention implementation {saved!r}; kvsqueeze's "
                                    "attention falls back on 'sdpa' or 'eager': load the model with one of them")
    register_attention()
    model.set_attn_implementation(EAGER_NAME if saved == "eager" else ATTN_NAME)
    return saved
