"""Find the pieces of a transformers decoder we hook into, without knowing its class.

LLaMA, Mistral and Qwen2 (and most decoders in transformers) expose attention
modules with `k_proj` / `v_proj` linears and a rotary-embedding module that
returns (cos, sin) for position ids (the rotation itself: `kvsqueeze.rope`).
"""

from __future__ import annotations

import torch


def attention_modules(model) -> list:
    """Self-attention modules in layer order (those with k_proj, v_proj and a layer_idx)."""
    mods = [
        m for m in model.modules()
        if hasattr(m, "k_proj") and hasattr(m, "v_proj") and hasattr(m, "layer_idx")
    ]
    if not mods:
        raise ValueError(
            f"{type(model).__name__} has no attention modules with k_proj/v_proj projections; "
            "kvsqueeze supports LLaMA-style decoders (LLaMA, Mistral, Qwen2, SmolLM, ...)"
        )
    return sorted(mods, key=lambda m: m.layer_idx)


def rotary_module(model):
    """The model's rotary-embedding module (forward(x, position_ids) -> (cos, sin))."""
    for m in model.modules():
        if type(m).__name__.endswith("RotaryEmbedding"):
            return m
    raise ValueError(f"{type(model).__name__} has no rotary embedding module; kvsqueeze needs a RoPE model")


def rope_cos_sin(model, positions: torch.Tensor, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] for absolute `positions` [T], computed by the model's own rotary module."""
    rot = rotary_module(model)
    probe = torch.zeros(1, dtype=dtype, device=positions.device)
    cos, sin = rot(probe, positions.view(1, -1))
    return cos[0], sin[0]


def key_source(attn) -> str:
    """Where the keys of `attn` are read before RoPE: "k_norm" where the module normalizes its keys (Qwen3,
    OLMo-2, Gemma-3), else "k_proj"."""
    return "k_norm" if isinstance(getattr(attn, "k_norm", None), torch.nn.Module) else "k_proj"


def key_module(attn) -> torch.nn.Module:
    """The last module `attn` applies to its keys before its rotary step (see `key_source`)."""
    return getattr(attn, key_source(attn))


def hook_projections(model, fn, kinds: tuple[str, ...] = ("k", "v")) -> list:
    """Forward hooks where each attention module's keys ("k": `key_module`) and values ("v": `v_proj`) are made.

    `fn(layer, kind, output)` sees each output — [B, T, C], or [B, T, H, D] where a per-head `k_norm` makes
    the keys (`flatten(2)` gives [B, T, C] either way) — and may return a tensor of its shape to replace it
    (None keeps it). This is the one place kvsqueeze reads keys and values where the model makes them.

    Returns:
        The hook handles; `remove()` each when done.
    """
    handles = []
    for i, attn in enumerate(attention_modules(model)):
        for kind in kinds:
            module = key_module(attn) if kind == "k" else attn.v_proj
            handles.append(module.register_forward_hook(lambda m, inputs, output, i=i, kind=kind: fn(i, kind, output)))
    return handles


def read_forward(model, ids: torch.Tensor) -> tuple[dict[tuple[int, str], torch.Tensor], object]:
    """One forward of ids [B, T] (no gradient) into a transformers `DynamicCache`.

    Returns:
        (reads, cache): reads[(layer, "k" | "v")] are the keys and values where kvsqueeze reads them
        (`hook_projections`), [B, T, C]; the cache holds what the model cached (keys after RoPE).
    """
    from transformers import DynamicCache

    reads: dict[tuple[int, str], torch.Tensor] = {}
    handles = hook_projections(model, lambda layer, kind, out: reads.__setitem__((layer, kind), out.detach().flatten(2)))
    cache = DynamicCache(config=model.config)
    try:
        with torch.no_grad():
            model(ids, cache=cache, use_cache=True)
    finally:
        for h in handles:
            h.remove()
    return reads, cache
