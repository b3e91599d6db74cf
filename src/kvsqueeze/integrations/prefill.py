"""One dense prefill, many quantized caches: a prompt's keys and values recorded once and handed to each method.

A server prefills a prompt with exact attention and then keeps its keys and
values in its (compressed) cache; the answer is decoded from that cache. Long
prefills dominate the cost of long-context evaluation on a CPU, and they are
the same for every method, so `dense_prefill` runs the model once (in chunks
of `chunk` tokens, each attending exactly to everything before it) and keeps
what every cache needs: the pre-RoPE keys as the model hands them to its
rotary step (captured like the compressed cache captures them, and checked to
rotate into the model's keys), the post-RoPE keys, the values and positions.

`filled_cache(model, recipe, spec, prefill)` then builds a method's cache
holding exactly those tokens:

* methods the compressed cache stores (`cache.check_supported`): a
  `CompressedCache` whose layers quantize the recorded pre-RoPE keys and
  values (`append_pre_rope`), the same call `update` makes in a forward;
  `fp16`: its layers round the post-RoPE keys and values to fp16;
* every other method (KIVI, per-token or post-RoPE int/nf, turbo): a cache of
  the simulated path, with keys and values fake-quantized as the simulated
  path quantizes them on entry (pre-RoPE keys, then RoPE; post-RoPE keys by
  the cache layer; KIVI in attention), to be used inside the method's
  `SimulatedQuantization`.

Only models whose layers all attend to every token are recorded (a sliding
window would change what the prefill attends to); others are refused with the
way out.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..methods import MethodError, MethodSpec
from ..recipe import Recipe
from ..shape import kv_shape
from .capture import ForwardCapture
from .layers import LayerBase, PreRopeKeys, _positions
from .parts import layer_rotaries, layer_windows
from .preflight import UnsupportedModelError, preflight
from .simulate import SimulatedQuantization, _quantize_tokens


@dataclass
class DensePrefill:
    """What one exact prefill of a prompt leaves: per layer, [B, T, C] pre-RoPE keys and values, [B, H, T, D]
    post-RoPE keys, and the positions [B, T]."""

    ids: torch.Tensor  # [B, T] the prompt
    pre_keys: list[torch.Tensor]
    post_keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: torch.Tensor

    @property
    def tokens(self) -> int:
        return self.ids.shape[1]

    def save(self, path: str | Path) -> Path:
        """Write every tensor to one safetensors file (through a temporary name: never half-written)."""
        from safetensors.torch import save_file

        path = Path(path)
        named = {"ids": self.ids, "positions": self.positions}
        for part in ("pre_keys", "post_keys", "values"):
            named.update({f"{part}.{i}": t for i, t in enumerate(getattr(self, part))})
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        save_file({k: v.detach().contiguous().cpu() for k, v in named.items()}, str(tmp))
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path, ids: torch.Tensor) -> DensePrefill:
        """The prefill `save` wrote, on `ids`' device; refused (ValueError) unless it was made for these `ids`."""
        from safetensors.torch import load_file

        try:
            named = load_file(str(path), device=str(ids.device))
        except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same advice
            raise ValueError(f"{path} is not a saved prefill ({exc}); delete it") from exc
        if "ids" not in named or not torch.equal(named["ids"], ids):
            raise ValueError(f"{path} holds the prefill of other tokens; delete it")
        layers = sum(1 for k in named if k.startswith("pre_keys."))
        parts = {part: [named[f"{part}.{i}"] for i in range(layers)] for part in ("pre_keys", "post_keys", "values")}
        return cls(named["ids"], parts["pre_keys"], parts["post_keys"], parts["values"], named["positions"])


class RecordingLayer(PreRopeKeys, LayerBase):
    """A full-attention layer that attends exactly (like `DynamicLayer`) and records pre-RoPE keys on the side."""

    def __init__(self, layer_idx: int, rotary, capture: ForwardCapture):
        super().__init__(None)
        self.layer_idx, self.rotary, self.capture = layer_idx, rotary, capture
        self.keys = self.values = None
        self.pre_keys: list[torch.Tensor] = []
        self.positions: list[torch.Tensor] = []

    def kept_tokens(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        extra = kwargs.get("kwargs") or {}
        b, h, t, d = key_states.shape
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        positions = _positions(extra.get("position_ids", kwargs.get("position_ids")), b, t, self.kept_tokens(),
                               key_states.device)
        self.pre_keys.append(self._pre_rope_keys(key_states, self._cos_sin(positions, key_states.dtype)))
        self.positions.append(positions)
        if self.keys is None:
            self.keys, self.values = key_states, value_states
        else:
            self.keys = torch.cat([self.keys, key_states], dim=2)
            self.values = torch.cat([self.values, value_states], dim=2)
        return self.keys, self.values


def check_full_attention(model, engine_hint: str) -> None:
    """Refuse a model with sliding-window layers (their prefill attends to a window, not to everything)."""
    try:
        windows = layer_windows(model)
    except ValueError as exc:
        raise UnsupportedModelError(str(exc)) from exc
    sliding = [i for i, w in enumerate(windows) if w is not None]
    if sliding:
        raise UnsupportedModelError(
            f"{type(model).__name__} has sliding-window attention in layers {sliding[:8]}"
            f"{' ...' if len(sliding) > 8 else ''}: one dense prefill shared by every method records full-attention "
            f"layers only. {engine_hint}")


@torch.no_grad()
def dense_prefill(model, ids: torch.Tensor, chunk: int = 2048,
                  engine_hint: str = "Prefill through each method's own cache instead") -> DensePrefill:
    """Run `ids` [B, T] through `model` in chunks with exact attention, recording every layer's K/V."""
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    check_full_attention(model, engine_hint)
    preflight(model)  # keys captured where the model rotates them, or a clear refusal now
    shape = kv_shape(model.config)
    rotaries = layer_rotaries(model, shape.head_dim)
    capture = ForwardCapture.acquire(model)
    try:
        layers = [RecordingLayer(i, rotaries[i], capture) for i in range(shape.layers)]
        cache = Cache(layers=layers)
        for s in range(0, ids.shape[1], chunk):
            model(input_ids=ids[:, s:s + chunk], cache=cache, use_cache=True, logits_to_keep=1)
    finally:
        capture.release()
    b, t = ids.shape
    values = [layer.values.transpose(1, 2).reshape(b, t, -1) for layer in layers]  # [B, T, C]
    return DensePrefill(ids, [torch.cat(layer.pre_keys, dim=1) for layer in layers],
                        [layer.keys for layer in layers], values, torch.cat(layers[0].positions, dim=1))


def compressed(spec: MethodSpec) -> bool:
    """Whether the compressed cache stores `spec` (else the simulated path evaluates it)."""
    from .cache import check_supported

    try:
        check_supported(spec)
    except MethodError:
        return False
    return True


def filled_cache(model, recipe: Recipe | None, spec: MethodSpec, prefill: DensePrefill,
                 sim: SimulatedQuantization | None = None):
    """A cache of `spec` holding the recorded prompt, as if the model's forward had filled it.

    Without `sim`, a `CompressedCache` (for the methods it stores; close it when done). With `sim` (the
    method's entered `SimulatedQuantization`; required for the others), a cache of the simulated path, used
    inside it. Both hold the same numbers for the methods both can do.
    """
    from .cache import cache_for

    b, t = prefill.ids.shape
    if sim is None:
        cache = cache_for(model, recipe, spec)
        for i, layer in enumerate(cache.layers):
            if not spec.quantized:
                heads, d = prefill.post_keys[i].shape[1], prefill.post_keys[i].shape[3]
                layer.update(prefill.post_keys[i], prefill.values[i].view(b, t, heads, d).transpose(1, 2))
            else:
                layer.append_pre_rope(prefill.pre_keys[i], prefill.values[i], prefill.positions)
        return cache
    if sim.spec != spec:
        raise ValueError(f"`sim` simulates {sim.spec.name!r}, not {spec.name!r}")
    cache = sim.new_cache()
    shape = sim.shape
    rotaries = layer_rotaries(model, shape.head_dim) if spec.pre_rope_keys else None
    for i, layer in enumerate(cache.layers):
        values = prefill.values[i]
        if sim.v[i] is not None:
            values, n = _quantize_tokens(sim.v[i], values, 0, spec.sinks)
            sim.counter.add("v", i, n)
        values = values.view(b, t, shape.kv_heads, shape.head_dim).transpose(1, 2)  # [B, H, T, D]
        if sim.k_pre[i] is not None:
            keys, n = _quantize_tokens(sim.k_pre[i], prefill.pre_keys[i], 0, spec.sinks)
            sim.counter.add("k", i, n)
            cs = rotaries[i].cos_sin(prefill.positions, keys.dtype)
            cs = None if cs is None else (cs[0].unsqueeze(1), cs[1].unsqueeze(1))
            keys = rotaries[i].apply(keys.view(b, t, shape.kv_heads, shape.head_dim).transpose(1, 2), cs)
            DynamicLayer.update(layer, keys.to(prefill.post_keys[i].dtype), values)
        else:
            layer.update(prefill.post_keys[i], values)  # post-RoPE keys quantized on entry (KIVI: in attention)
    return cache
