"""A model's fingerprint for its recipe: shapes, a hash of the first key projection and a few of its weights."""

from __future__ import annotations

import hashlib

import torch

from ..recipe import PROBES, Recipe
from ..shape import kv_shape
from .parts import attention_modules, key_weight


def model_fingerprint(model) -> dict:
    """Shapes, a hash of the first key projection's weights and a few of those weights (`same_weights`)."""
    shape = kv_shape(model.config)
    first = key_weight(attention_modules(model)[0], shape.channels).detach().float().cpu().contiguous()
    flat = first.view(-1)
    probe = flat[torch.linspace(0, flat.numel() - 1, min(PROBES, flat.numel())).round().long()]
    return {
        "layers": shape.layers,
        "heads": shape.heads,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "hidden_size": int(model.config.hidden_size),
        "vocab_size": int(model.config.vocab_size),
        "k_proj_sha256": hashlib.sha256(first.numpy().tobytes()).hexdigest()[:16],
        "k_proj_probe": probe.tolist(),
    }


def check_recipe(recipe: Recipe, model) -> None:
    """Raise RecipeError unless `recipe` was calibrated on `model` (at any of fp32, bf16, fp16)."""
    recipe.check_fingerprint(model_fingerprint(model))
