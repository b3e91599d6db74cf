"""A model's fingerprint for its recipe: shapes, a hash and a few probed weights of every layer's keys, and a few
probed elements of every tensor."""

from __future__ import annotations

import copy
import json
import weakref

from ..recipe import Recipe, key_digest, tensor_probe
from ..shape import kv_shape
from .parts import attention_modules, key_weight, layer_windows

# each model's fingerprint, with the state of its parameters it was taken from: hashing every key projection
# and probing every tensor again for each cache or evaluation of the same weights costs seconds on a large model
_TAKEN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _state(model) -> tuple:
    """What a fingerprint depends on: each parameter's storage, version counter (bumped by any in-place change),
    dtype and shape, and the config's sizes."""
    return (tuple((n, p.data_ptr(), p._version, p.dtype, tuple(p.shape)) for n, p in model.named_parameters()),
            model.config.to_json_string(use_diff=False))


def model_fingerprint(model) -> dict:
    """Shapes, and for every layer a hash of its key projection's weights and a few of those weights, evenly
    spaced over the matrix (`recipe.same_weights` compares them across a change of precision). Taken once per
    state of the model's weights (a copy is returned: callers may keep and change it)."""
    try:
        state = _state(model)
    except RuntimeError:  # inference tensors keep no version counter: taken every time
        return _fingerprint(model)
    hit = _TAKEN.get(model)
    if hit is None or hit[0] != state:
        hit = _TAKEN[model] = (state, _fingerprint(model))
    return copy.deepcopy(hit[1])


def _fingerprint(model) -> dict:
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
        # each layer's sliding window (None: every token): what a bit budget charges each layer for holding
        "layer_windows": layer_windows(model),
        # how keys turn (theta, scaling, partial rotary): post-RoPE ranges, and every statistic after the first
        # attention, were measured under it
        "rope": rope_config(model.config),
        # a few elements of every tensor: a fine-tune that left the key projections alone changes the keys and
        # values the recipe was fitted to through every layer before them
        "weights_probe": {name: tensor_probe(p) for name, p in model.named_parameters()},
    }


def rope_config(config) -> dict:
    """The config's RoPE settings as JSON holds them: `rope_parameters` (or the older `rope_scaling` and
    `rope_theta`) and `partial_rotary_factor`, unset entries left out."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    out = json.loads(json.dumps(params, sort_keys=True, default=str)) if isinstance(params, dict) else {}
    for name in ("rope_theta", "partial_rotary_factor"):
        value = getattr(config, name, None)
        if value is not None and name not in out:
            out[name] = float(value)
    return {k: v for k, v in sorted(out.items()) if v is not None}


def check_recipe(recipe: Recipe, model) -> None:
    """Raise RecipeError unless `recipe` was calibrated on `model` (at any of fp32, bf16, fp16)."""
    recipe.check_fingerprint(model_fingerprint(model))
