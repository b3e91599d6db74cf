"""Preflight: one short forward that checks, layer by layer, that kvsqueeze reads the keys the model rotates.

KVQuant quantizes keys before RoPE (Hooper et al., arXiv 2401.18079, Section
3.2), so every path of kvsqueeze (calibration, simulation, the compressed cache,
the kernels) must read each key where the model hands it to its rotary step:
the output of the attention module's `k_norm` where it has one (Qwen3,
OLMo-2, Gemma-3), else its `k_proj` (`parts.key_module`). Values are read at
`v_proj`. Each layer turns its keys as its `parts.LayerRotary` says (its layer
type's frequencies, partial rotary, or no RoPE).

The check runs the model once over a few tokens with transformers'
`DynamicCache` and compares, for every layer, the keys and values read there
(keys turned by the layer's rotation at their positions) with what the model
handed its cache. A layer where they differ — keys clipped or scaled inline,
interleaved RoPE pairs, a layer without RoPE that does not say so, fused q/k/v
projections — makes the model refused before any expensive work, with the
layer, the family and what differs. So is RoPE whose frequencies change with
the sequence length (dynamic NTK, LongRoPE): the model caches each key turned
by the frequencies of its own step, which a cache that turns keys at read time
cannot reproduce. A model that passed is remembered (per model object), so the
check costs one forward.
"""

from __future__ import annotations

import weakref

import torch

from ..shape import kv_shape
from .parts import attention_modules, key_source, layer_rotaries, layer_windows, read_forward, rotary_module

PREFLIGHT_TOKENS = 8  # enough positions for every rotary pair to turn; the forward costs next to nothing
_PASSED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> the checks it passed


class UnsupportedModelError(ValueError):
    """A model whose keys kvsqueeze cannot read before RoPE (or whose cache layout it does not know)."""


def _family(model) -> str:
    return f"{type(model).__name__} (model_type {getattr(model.config, 'model_type', '?')!r})"


def _refuse(model, layer: int | None, what: str, fix: str = "") -> UnsupportedModelError:
    where = f"layer {layer} of " if layer is not None else ""
    fix = fix or ("kvsqueeze supports decoders whose attention turns its `k_proj` output (or its `k_norm` output, "
                  "or the key slice of a fused `qkv_proj`) by rotate-half RoPE, over the whole head or its leading "
                  "channels, per layer type, or not at all in layers marked `use_rope=False` (LLaMA, Mistral, "
                  "Qwen2/3, Gemma-2/3, Phi, Phi-3, OLMo-2, SmolLM3, ...); methods that quantize keys after RoPE "
                  "through the simulated path (e.g. int3, kivi2) do not depend on it")
    return UnsupportedModelError(f"{where}{_family(model)}: {what}; {fix}")


def preflight(model, keys: bool = True) -> None:
    """Raise `UnsupportedModelError` unless every layer's values, read where kvsqueeze reads them, are the values
    the model caches, and (with `keys`) its keys, read there and turned by the model's RoPE, the keys it caches.

    `keys=False` is for methods that quantize keys after RoPE, as the model caches them. Runs once per model
    object and check (a few tokens, no gradient); later calls return at once.
    """
    done = _PASSED.get(model, set())
    if "keys" in done or (not keys and "values" in done):
        return
    try:
        attn = attention_modules(model)
    except ValueError as exc:
        raise _refuse(model, None, str(exc).split(";")[0],
                      "kvsqueeze reads keys and values at `k_proj` / `v_proj` or at the key and value slices of a "
                      "fused `qkv_proj` laid out queries, keys, values (Phi-3); other fused layouts (GPT-NeoX "
                      "`query_key_value`, interleaved per head) are not supported") from exc
    _check_layers(model, attn)
    clip = getattr(model.config, "clip_qkv", None)
    if clip is not None:  # in place after k_proj and v_proj: neither the keys nor the values can be read
        raise _refuse(model, 0, f"keys and values are clipped in place to +-{clip} after their projections "
                      "(clip_qkv), where no module can be hooked", "load the model with clip_qkv=None only if "
                      "it was trained without clipping; otherwise it is not supported")
    shape = kv_shape(model.config)
    device = next(model.parameters()).device
    vocab = int(getattr(model.config, "vocab_size", 2) or 2)
    ids = (torch.arange(PREFLIGHT_TOKENS, device=device) * 7 + 3).remainder(vocab).view(1, -1)
    broken = [name for name, w in model.named_parameters() if w.is_floating_point() and not torch.isfinite(w).all()]
    if broken:  # not a question of architecture: every comparison below would fail on NaN
        raise UnsupportedModelError(
            f"{type(model).__name__} holds NaN/Inf weights ({', '.join(broken[:3])}"
            f"{' ...' if len(broken) > 3 else ''}): the checkpoint is broken (a bad download or conversion); "
            "load a sound copy of the model")
    chunked = [i for i, kind in enumerate(getattr(model.config, "layer_types", None) or ()) if "chunk" in str(kind)]
    if chunked:  # transformers caches them as sliding windows, but a query reads only its own chunk
        raise _refuse(model, chunked[0], "it attends within chunks of its tokens (chunked attention), which kvsqueeze "
                      "caches do not implement (full and sliding-window layers only)")
    read, cache = read_forward(model, ids)
    t, h, d = PREFLIGHT_TOKENS, shape.kv_heads, shape.head_dim
    if keys:
        try:
            kind = getattr(rotary_module(model), "rope_type", None)
        except ValueError as exc:
            raise _refuse(model, None, str(exc).split(";")[0], "methods that quantize keys after RoPE (e.g. int4, "
                          "kivi2) do not need one") from exc
        kinds = set(kind.values()) if isinstance(kind, dict) else {kind}
        moving = sorted(k for k in kinds if k in ("dynamic", "longrope"))
        if moving:
            raise _refuse(model, None, f"its RoPE ({moving[0]}) changes its frequencies with the sequence length, "
                          "and the model caches each key turned by the frequencies of the step that wrote it, which "
                          "keys stored before RoPE and turned at read time cannot reproduce", "use a method that "
                          "quantizes keys after RoPE (e.g. int4, kivi2), or a fixed rope scaling (linear, llama3, "
                          "yarn)")
        rotaries = layer_rotaries(model, d)
        positions = torch.arange(PREFLIGHT_TOKENS, device=device).view(1, -1)
        try:
            turns = [r.cos_sin(positions) for r in rotaries]
        except TypeError as exc:
            raise _refuse(model, 0, f"its rotary module cannot be called with positions (and a layer type) "
                          f"alone ({exc})") from exc
        for i, turn in enumerate(turns):
            pair = isinstance(turn, (tuple, list)) and len(turn) == 2 and all(
                isinstance(c, torch.Tensor) and not c.is_complex() for c in turn)
            if turn is not None and not pair:
                what = ("complex frequencies (keys turned in interleaved pairs, as Llama-4 does)"
                        if isinstance(turn, torch.Tensor) and turn.is_complex() else f"a {type(turn).__name__}")
                raise _refuse(model, i, f"its rotary module gives {what}, not the (cos, sin) pair of rotate-half "
                              "RoPE that kvsqueeze turns keys by", "use a method that quantizes keys after RoPE "
                              "(e.g. int4, kivi2)")
    eps = torch.finfo(next(model.parameters()).dtype).eps
    for i in range(len(attn)):
        cached_k, cached_v = cache.layers[i].keys.float(), cache.layers[i].values.float()  # [1, H, T, D]
        kept = cached_k.shape[-2]  # a sliding-window layer keeps only the most recent tokens
        if not 0 < kept <= t:
            raise _refuse(model, i, f"its cache layer holds {kept} tokens after a forward over {t}")
        if (i, "k") not in read or (i, "v") not in read:
            missing = key_source(attn[i]) if (i, "k") not in read or key_source(attn[i]) == "qkv_proj" else "v_proj"
            raise _refuse(model, i, f"its `{missing}` is not called in the forward, so its output is not the "
                          "tensor the model caches")
        k = read[(i, "k")].float().reshape(1, t, h, d).transpose(1, 2)[:, :, t - kept :]
        v = read[(i, "v")].float().reshape(1, t, h, d).transpose(1, 2)[:, :, t - kept :]
        if keys:
            cs = None if turns[i] is None else tuple(c[:, t - kept :].float().unsqueeze(1) for c in turns[i])
            try:
                turned = rotaries[i].apply(k, cs)
            except RuntimeError as exc:  # a rotary width that is not the layer's turning channels
                raise _refuse(model, i, f"its rotary module's cos / sin ({tuple(cs[0].shape) if cs else None}) "
                              f"do not turn its {d}-channel heads as rotate-half RoPE over their leading channels "
                              f"({exc})", "use a method that quantizes keys after RoPE (e.g. int4, kivi2)") from exc
            if not _close(turned, cached_k, eps):
                source = key_source(attn[i])
                if rotaries[i].turns and _close(k, cached_k, eps):
                    what = (f"its keys are cached as its `{source}` gives them, without RoPE (a layer without "
                            "RoPE whose attention module does not say so with `use_rope`)")
                elif not rotaries[i].turns:
                    what = (f"its attention module says it uses no RoPE, yet the keys it caches are not its "
                            f"`{source}` output")
                else:
                    what = (f"the keys it caches are not its `{source}` output turned by rotate-half RoPE "
                            f"(largest difference {float((turned - cached_k).abs().max()):.3g} against keys up to "
                            f"{float(cached_k.abs().max()):.3g}: keys changed between the projection and RoPE, "
                            "or another pairing of the rotary channels)")
                raise _refuse(model, i, what)
        if not _close(v, cached_v, eps):
            where = "the value slice of its `qkv_proj`" if key_source(attn[i]) == "qkv_proj" else "its `v_proj` output"
            raise _refuse(model, i, f"the values it caches are not {where} "
                          f"(largest difference {float((v - cached_v).abs().max()):.3g})")
    _PASSED[model] = done | {"values"} | ({"keys"} if keys else set())



def model_windows(model) -> list[int | None]:
    """Each layer's sliding window as the caches keep it (None: every token; `parts.layer_windows`), what a preset's
    fp16 window follows (`methods.preset_for`); a layer kind the caches do not hold (chunked attention, linear
    attention, ...) is refused, naming the model's family."""
    try:
        return layer_windows(model)
    except ValueError as exc:
        raise _refuse(model, None, str(exc).split(";")[0], "kvsqueeze caches full and sliding-window attention "
                      "layers only") from exc


def _check_layers(model, attn: list) -> None:
    """One self-attention per decoder layer, each full or sliding-window: hybrids (linear attention, state-space
    layers) and decoders with cross-attention are refused here, before any forward."""
    model_windows(model)
    layers = kv_shape(model.config).layers
    cross = [i for i, a in enumerate(attn) if getattr(a, "is_cross_attention", False)]
    if cross or len(attn) != layers:
        what = (f"attention module {cross[0]} attends to an encoder's states (cross-attention)" if cross else
                f"it has {len(attn)} attention modules for {layers} layers")
        raise _refuse(model, None, what, "kvsqueeze caches decoders with one self-attention per layer")


def check_methods(model, specs, recipe) -> None:
    """Everything a run of `specs` on `model` needs, checked before minutes of work: the recipe belongs to the
    model, the keys and values are read where the model rotates and caches them, and every layer's quantizers
    build for every method (a bad combination of method, recipe and layer fails here)."""
    from ..methods import build_quantizers
    from .fingerprint import check_recipe

    try:
        attn = attention_modules(model)
    except ValueError:
        attn = None  # the methods that read the model's tensors are refused below, by preflight, with the reason
    if attn is not None:
        _check_layers(model, attn)
    if recipe is not None:
        check_recipe(recipe, model)
    if any(s.reads_model_tensors for s in specs):
        preflight(model, keys=any(s.pre_rope_keys for s in specs))
    shape = kv_shape(model.config)
    for s in specs:
        for layer in range(shape.layers):
            build_quantizers(s, recipe, layer, shape.channels, shape.head_dim)

def _close(a: torch.Tensor, b: torch.Tensor, eps: float) -> bool:
    """Equal up to a few roundings of the model's dtype (eps: its machine epsilon), relative to b's largest value."""
    if a.shape != b.shape:
        return False
    tol = max(4 * eps, 1e-5) * float(b.abs().max().clamp_min(1e-6))
    return bool((a - b).abs().max() <= tol)
