"""Find the pieces of a transformers decoder we hook into, without knowing its class.

LLaMA, Mistral and Qwen2 (and most decoders in transformers) expose attention
modules with `k_proj` / `v_proj` linears and a rotary-embedding module that
returns (cos, sin) for position ids (the rotation itself: `kvsqueeze.numerics.rope`).
How each layer turns its keys is its `LayerRotary`: the model's rotary module
called as the model calls it for that layer (with its layer type where the
module keeps one set of frequencies per type, as Gemma-3's local and global
layers do), over the leading `rotary_dim` channels of a head (partial rotary:
Phi, StableLM), or no rotation at all (SmolLM3's NoPE layers).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from ..numerics.rope import Rope, apply_rope


FUSED = "qkv_proj"  # one linear making queries, keys and values, in that order along its output (Phi-3)


def attention_modules(model) -> list:
    """Self-attention modules in layer order: those with a layer_idx and either k_proj and v_proj, or a fused
    `qkv_proj` (Phi-3; `fused_slices` says where its keys and values are)."""
    mods = [
        m for m in model.modules()
        if hasattr(m, "layer_idx") and ((hasattr(m, "k_proj") and hasattr(m, "v_proj")) or hasattr(m, FUSED))
    ]
    if not mods:
        raise ValueError(
            f"{type(model).__name__} has no attention modules with k_proj/v_proj (or qkv_proj) projections; "
            "kvsqueeze supports LLaMA-style decoders (LLaMA, Mistral, Qwen2, SmolLM, ...)"
        )
    return sorted(mods, key=lambda m: m.layer_idx)


def fused_slices(attn, channels: int) -> tuple[slice, slice] | None:
    """(keys, values): where a fused `qkv_proj` puts them along its output of Cq + 2 * C features (queries first,
    then the C key and C value channels); None for separate projections."""
    if hasattr(attn, "k_proj"):
        return None
    width = getattr(attn, FUSED).out_features
    q = width - 2 * channels
    return slice(q, q + channels), slice(q + channels, width)


def key_weight(attn, channels: int) -> torch.Tensor:
    """The weight rows [C, hidden] that make the keys of `attn` (its `k_proj`, or the key rows of `qkv_proj`)."""
    fused = fused_slices(attn, channels)
    return attn.k_proj.weight if fused is None else getattr(attn, FUSED).weight[fused[0]]


def rotary_module(model):
    """The model's rotary-embedding module (forward(x, position_ids) -> (cos, sin))."""
    for m in model.modules():
        if type(m).__name__.endswith("RotaryEmbedding"):
            return m
    raise ValueError(f"{type(model).__name__} has no rotary embedding module; kvsqueeze needs a RoPE model")


@dataclass(eq=False)
class LayerRotary:
    """How one attention layer turns its keys, computed by the model's own rotary module.

    Args:
        module: the rotary-embedding module; None for a layer without RoPE.
        layer_type: passed to `module` where its forward takes one (Gemma-3), else None.
        rotary_dim: the leading channels of a head that turn (the head dimension unless partial rotary).
        head_dim: channels per head.
    """

    module: torch.nn.Module | None
    layer_type: str | None
    rotary_dim: int
    head_dim: int
    _rope: tuple | None = field(default=None, repr=False)  # (frequency tensor, its version, Rope)

    @property
    def turns(self) -> bool:
        return self.module is not None

    def cos_sin(self, positions: torch.Tensor, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos, sin [B, T, R] (R = rotary_dim, or R/2 where the module gives half width) as the model's attention
        gets them for positions [B, T]; None for a layer without RoPE."""
        if self.module is None:
            return None
        probe = torch.zeros(1, dtype=dtype, device=positions.device)
        args = (self.layer_type,) if self.layer_type is not None else ()
        return self.module(probe, positions.long(), *args)

    def apply(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """x [..., T, D] turned by `cos_sin` (from `cos_sin`, broadcastable to x's [..., T]); unchanged if None."""
        if cos_sin is None:
            return x
        cos, sin = cos_sin
        return apply_rope(x, cos.to(x.dtype), sin.to(x.dtype), self.rotary_dim)

    @property
    def rope(self) -> Rope:
        """The layer's frequencies for the kernels (`Rope.from_rotary`; `Rope.identity` without RoPE), read
        again only when the module's frequency tensor changes."""
        if self.module is None:
            if self._rope is None:
                self._rope = (None, None, Rope.identity(self.head_dim))
            return self._rope[2]
        name = f"{self.layer_type}_inv_freq" if self.layer_type else "inv_freq"
        freq = getattr(self.module, name, None)
        hit = self._rope
        if (hit is not None and freq is not None and hit[0] is freq and not freq.is_inference()
                and hit[1] == freq._version):
            return hit[2]
        rope = Rope.from_rotary(self.module, self.layer_type)
        self._rope = (freq, freq._version if freq is not None and not freq.is_inference() else None, rope)
        return rope


def _rotary_dim(config, attn, head_dim: int) -> int:
    """Channels of a head that turn: from the attention module (`rotary_ndims`) or the config's
    `partial_rotary_factor` (in `rope_parameters` or on the config), else all of them."""
    ndims = (getattr(attn, "rotary_ndims", None) or getattr(attn, "rotary_emb_dim", None)
             or getattr(attn, "rotary_dim", None))
    if isinstance(ndims, int) and 0 < ndims <= head_dim:
        return ndims
    params = getattr(config, "rope_parameters", None)
    factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    if factor is None:
        factor = getattr(config, "partial_rotary_factor", None)
    if factor is not None and 0 < float(factor) < 1:
        return int(head_dim * float(factor))
    return head_dim


def layer_rotaries(model, head_dim: int) -> list[LayerRotary]:
    """One `LayerRotary` per attention module, in layer order.

    A layer has no RoPE where its attention module says so (`use_rope` false, as SmolLM3's NoPE layers);
    a rotary module whose forward takes a `layer_type` is called with the layer's (`config.layer_types`).
    """
    attn = attention_modules(model)
    rot = rotary_module(model)
    typed = "layer_type" in inspect.signature(rot.forward).parameters
    types = getattr(model.config, "layer_types", None)
    out = []
    for i, a in enumerate(attn):
        if not getattr(a, "use_rope", True):
            out.append(LayerRotary(None, None, head_dim, head_dim))
            continue
        layer_type = None
        if typed:
            layer_type = getattr(a, "layer_type", None) or (types[i] if types else None)
        out.append(LayerRotary(rot, layer_type, _rotary_dim(model.config, a, head_dim), head_dim))
    return out


KEY_NORMS = ("k_norm", "k_layernorm")  # a module's key norm, applied before RoPE (StableLM names it k_layernorm)


def key_source(attn) -> str:
    """Where the keys of `attn` are read before RoPE: its key norm where the module normalizes its keys ("k_norm":
    Qwen3, OLMo-2, Gemma-3; "k_layernorm": StableLM with qk_layernorm), else "k_proj", or "qkv_proj" where one
    linear makes queries, keys and values."""
    for name in KEY_NORMS:
        if isinstance(getattr(attn, name, None), torch.nn.Module):
            return name
    return "k_proj" if hasattr(attn, "k_proj") else FUSED


def key_module(attn) -> torch.nn.Module:
    """The last module `attn` applies to its keys before its rotary step (see `key_source`)."""
    return getattr(attn, key_source(attn))


def hook_projections(model, fn, kinds: tuple[str, ...] = ("k", "v")) -> list:
    """Forward hooks where each attention module's keys ("k": `key_module`) and values ("v": `v_proj`) are made.

    `fn(layer, kind, output)` sees each output — [B, T, C], or [B, T, H, D] where a per-head `k_norm` makes
    the keys (`flatten(2)` gives [B, T, C] either way; a norm over [B, H, T, D] is handed over transposed) —
    and may return a tensor of its shape to replace it (None keeps it). This is the one place kvsqueeze reads
    keys and values where the model makes them. A fused `qkv_proj` is hooked once: `fn` sees its key and
    value slices, and what it returns replaces them.

    Returns:
        The hook handles; `remove()` each when done.
    """
    from ..shape import kv_shape

    shape = kv_shape(model.config)
    channels, heads = shape.channels, shape.kv_heads
    handles = []
    for i, attn in enumerate(attention_modules(model)):
        fused = fused_slices(attn, channels) if key_source(attn) == FUSED else None
        if fused is not None:
            hook = lambda m, inputs, output, i=i: _split(fn, i, kinds, fused, output)  # noqa: E731
            handles.append(getattr(attn, FUSED).register_forward_hook(hook))
            continue
        for kind in kinds:
            module = key_module(attn) if kind == "k" else attn.v_proj
            handles.append(module.register_forward_hook(lambda m, inputs, output, i=i, kind=kind:
                                                        _token_major(fn, i, kind, inputs, output, heads)))
    return handles


def _token_major(fn, layer: int, kind: str, inputs: tuple, output: torch.Tensor, heads: int):
    """Call `fn` on output with tokens before heads ([B, T, ...]).

    A per-head norm applied after the heads were moved before the tokens (Gemma-3 normalizes keys [B, H, T, D])
    is handed its output as [B, T, H, D], and a replacement is turned back. Which dimension holds the `heads`
    tells the layouts apart; where both do (as many tokens as heads), the norm's input does: a transposed view
    of the contiguous projection, its token dimension (2) has the larger stride.
    """
    if output.dim() != 4:
        return fn(layer, kind, output)
    x = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
    if output.shape[1] == heads and output.shape[2] != heads:
        heads_first = True
    elif output.shape[2] == heads and output.shape[1] != heads:
        heads_first = False
    else:
        heads_first = x is not None and x.dim() == 4 and x.stride(2) > x.stride(1)
    if not heads_first:
        return fn(layer, kind, output)
    new = fn(layer, kind, output.transpose(1, 2))
    return None if new is None else new.transpose(1, 2)


def _split(fn, layer: int, kinds: tuple[str, ...], slices: tuple[slice, slice], output: torch.Tensor):
    """Call `fn` on the key and value slices of a fused projection's output; its replacements, joined back."""
    parts = {"k": slices[0], "v": slices[1]}
    new = {kind: fn(layer, kind, output[..., parts[kind]]) for kind in kinds}
    if all(x is None for x in new.values()):
        return None
    pieces = [output[..., : slices[0].start]]
    pieces += [new.get(kind) if new.get(kind) is not None else output[..., parts[kind]] for kind in ("k", "v")]
    return torch.cat(pieces, dim=-1)


def layer_windows(model) -> list[int | None]:
    """Each layer's sliding window as transformers' `DynamicCache` for this model's config keeps it (None: every
    token; `config_windows`).

    Raises:
        ValueError: a layer kind other than full or sliding-window (chunked attention, ...).
    """
    return config_windows(model.config, type(model).__name__)


def config_windows(config, what: str = "the model") -> list[int | None]:
    """Each layer's sliding window as transformers' `DynamicCache` for `config` keeps it (None: every token); `what`
    names the model in an error.

    Raises:
        ValueError: a layer kind other than full or sliding-window (chunked attention, ...).
    """
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    out = []
    kinds = list(getattr(config, "layer_types", None) or ())
    for i, layer in enumerate(DynamicCache(config=config).layers):
        if i < len(kinds) and "chunk" in str(kinds[i]):  # cached as a sliding window, read within its chunk
            raise ValueError(f"layer {i} of {what} attends within chunks of its tokens (chunked attention), a layer "
                             "kind kvsqueeze caches do not implement (full and sliding-window layers only)")
        if isinstance(layer, DynamicSlidingWindowLayer):
            out.append(int(layer.sliding_window))
        elif type(layer) is DynamicLayer:
            out.append(None)
        else:
            raise ValueError(f"layer {i} of {what} is cached as a {type(layer).__name__}, a layer kind kvsqueeze "
                             "caches do not implement (full and sliding-window layers only)")
    return out


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
