"""A model's fingerprint for its recipe: shapes, and a hash and a few probed weights of every layer's keys."""

from __future__ import annotations

import hashlib

import torch

from ..recipe import PROBES, Recipe, RecipeError
from ..shape import kv_shape
from .parts import attention_modules, key_weight


def key_digest(layer: int, weight: torch.Tensor) -> tuple[str, list[float]]:
    """Layer `layer`'s entry of a fingerprint from its key projection's weights [C, hidden]: a hash of them in
    float32 and `PROBES` of them evenly spaced over the matrix (what `recipe.same_weights` compares)."""
    flat = weight.detach().float().cpu().contiguous().view(-1)
    if not torch.isfinite(flat).all():
        raise RecipeError(f"layer {layer}'s key projection holds NaN/Inf weights: the model's weights are broken "
                          "(a bad download or conversion); load a sound copy of the model")
    probe = flat[torch.linspace(0, flat.numel() - 1, min(PROBES, flat.numel())).round().long()].tolist()
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16], probe


def model_fingerprint(model) -> dict:
    """Shapes, and for every layer a hash of its key projection's weights and a few of those weights, evenly
    spaced over the matrix (`recipe.same_weights` compares them across a change of precision)."""
    shape = kv_shape(model.config)
    digests = [key_digest(i, key_weight(attn, shape.channels)) for i, attn in enumerate(attention_modules(model))]
    hashes, probes = [d[0] for d in digests], [d[1] for d in digests]
    return {
        "layers": shape.layers,
        "heads": shape.heads,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "hidden_size": int(model.config.hidden_size),
        "vocab_size": int(model.config.vocab_size),
        "layers_sha256": hashes,
        "layers_probe": probes,
    }


def check_recipe(recipe: Recipe, model) -> None:
    """Raise RecipeError unless `recipe` was calibrated on `model` (at any of fp32, bf16, fp16)."""
    recipe.check_fingerprint(model_fingerprint(model))
