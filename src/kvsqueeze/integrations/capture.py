"""Forward hooks that hand the compressed cache what `Cache.update` does not receive.

In transformers 5.24, `cache.update(key_states, value_states, layer_idx,
kwargs=...)` gets keys *after* RoPE, `position_ids` and nothing about padding.
KVQuant stores keys *before* RoPE, and the cache needs to know which tokens are
padding so that sinks are each row's first real tokens. One `ForwardCapture`
per model (shared by every cache built on it, reference-counted) installs:

* a forward hook where each attention module makes its keys (`k_norm` or
  `k_proj`, `parts.key_module`): it stashes the output, the exact keys the
  model hands its rotary step [B, T, C], for that layer's `update` to take;
* a forward pre-hook on the decoder stack (`model.base_model`): it notes the
  2-D `attention_mask` [B, past + T] and `position_ids` of the forward in progress
  (for attention modules that keep theirs from `update`) and whether the
  forward uses a kvsqueeze cache at all (otherwise `k_proj` outputs are not
  kept); a forward hook (always called, errors included) clears the stash.

The stash only lives for the duration of one forward, and only the layer being
updated takes its own layer's keys, so two caches on one model never see each
other's tensors: whichever cache the forward was given is the one updated.
Hooks are removed when the last cache using them is closed or collected.
"""

from __future__ import annotations

import inspect
import weakref

import torch

from .layers import LayerBase
from .parts import hook_projections

_CAPTURES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> ForwardCapture


class ForwardCapture:
    """Pre-RoPE keys, the padding mask and the position ids of the forward in progress; see the module docstring."""

    def __init__(self, model):
        # No reference to the model or its modules is kept (the registry is keyed weakly by the model).
        self._signature = inspect.signature(model.base_model.forward)
        self._users = 0
        self._handles: list = []
        self.active = False  # inside a forward that was given a kvsqueeze cache
        self.mask: torch.Tensor | None = None  # 2-D attention mask of that forward, or None
        self.position_ids: torch.Tensor | None = None  # the decoder's 2-D position_ids of that forward, or None
        self.keys: dict[int, torch.Tensor] = {}  # layer -> pre-RoPE keys [B, T, C]

    # ---- lifetime ------------------------------------------------------------------------
    @classmethod
    def acquire(cls, model) -> "ForwardCapture":
        """The model's capture (created and hooked on first use), with one more user counted."""
        cap = _CAPTURES.get(model)
        if cap is None:
            cap = _CAPTURES[model] = cls(model)
        if cap._users == 0:
            cap._install(model)
        cap._users += 1
        return cap

    def retain(self) -> None:
        """One more user of hooks already installed (a copy of a cache that uses them)."""
        if not self.installed:
            raise RuntimeError("this cache was closed (its hooks on the model are gone): copy a cache while it is "
                               "open, or build a new one with cache_for")
        self._users += 1

    def __deepcopy__(self, memo) -> "ForwardCapture":
        return self  # one per model: a copied cache keeps reading the model's forward through the same hooks

    def release(self) -> None:
        """One user fewer; the hooks go when none is left."""
        self._users = max(0, self._users - 1)
        if self._users == 0:
            for h in self._handles:
                h.remove()
            self._handles.clear()
            self._clear()

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def _install(self, model) -> None:
        def before(module, args, kwargs):
            bound = self._signature.bind_partial(*args, **kwargs).arguments
            extra = bound.get("kwargs", {})
            cache = bound.get("cache", extra.get("cache", extra.get("past_key_values")))
            layers = getattr(cache, "layers", None) or []
            self.active = any(isinstance(layer, LayerBase) for layer in layers)  # a cache of ours turns it on
            mask = bound.get("attention_mask")
            self.mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
            pos = bound.get("position_ids", extra.get("position_ids"))
            self.position_ids = pos if isinstance(pos, torch.Tensor) and pos.dim() == 2 else None
            self.keys = {}

        def after(module, args, kwargs, output):
            self._clear()

        decoder = model.base_model
        self._handles.append(decoder.register_forward_pre_hook(before, with_kwargs=True))
        self._handles.append(decoder.register_forward_hook(after, with_kwargs=True, always_call=True))
        self._handles += hook_projections(model, self._keep_keys, kinds=("k",))

    def _keep_keys(self, layer: int, kind: str, output: torch.Tensor) -> None:
        if self.active:
            self.keys[layer] = output.flatten(2)

    def _clear(self) -> None:
        self.active = False
        self.mask = None
        self.position_ids = None
        self.keys = {}

    # ---- what a cache layer reads --------------------------------------------------------
    def take_keys(self, layer: int, batch: int, tokens: int) -> torch.Tensor | None:
        """This forward's pre-RoPE keys of `layer` [B, T, C], once; None if there are none of that shape."""
        keys = self.keys.pop(layer, None)
        if keys is None or keys.dim() != 3 or tuple(keys.shape[:2]) != (batch, tokens):
            return None
        return keys

    def positions(self, tokens: int) -> torch.Tensor | None:
        """This forward's `position_ids` [B or 1, T] as the decoder stack was given them, for attention modules that
        take them as a named argument and so do not hand them on to `cache.update` (StableLM); None if none were
        given (the decoder counts them from the cache's length, as `update` then does)."""
        pos = self.position_ids
        return pos if pos is not None and pos.shape[-1] == tokens else None

    def real_tokens(self, batch: int, tokens: int) -> torch.Tensor | None:
        """bool [B, T]: False at the padding tokens among this forward's T new ones (None: no 2-D mask)."""
        mask = self.mask
        if mask is None or mask.shape[0] != batch or mask.shape[1] < tokens:
            return None
        return mask[:, -tokens:] != 0
