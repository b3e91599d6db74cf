"""Simulated KV quantization inside a transformers forward pass (quantize -> dequantize).

This is how every method's quality is measured (the paper's ablations are
computed the same way). Nothing in the model is forked:

* pre-RoPE keys and all values are quantized by forward hooks on each
  attention module's `k_proj` / `v_proj` (their outputs are exactly the
  un-rotated keys and the values);
* post-RoPE keys are quantized as they enter the cache, by `SimulatedLayer`,
  a `DynamicLayer` whose `update` quantizes the new tokens;
* KIVI, whose fp16 window depends on the query position, runs in the
  attention function registered as "kvsqueeze" (see `kivi.py`);
* so does a nuq method with an fp16 window of recent tokens (`:rN`): the
  hooks hand the model each token's fp16 copy and keep its quantized copy;
  `SimulatedLayer` holds, beside the fp16 keys and values, the quantized
  ones (keys turned by the layer's own rotary module, as the compressed
  cache turns them), and attention reads, for each query, the fp16 copy of its `N`
  most recent tokens and the quantized copy of every older one
  (`kernels.mixed.mixed_attention`), as the compressed cache holds them.

Each token is quantized once, when it enters the cache, exactly like a real
compressed cache would, so prefill, teacher-forced evaluation and token-by-token
decoding all see the same numbers. The first `spec.sinks` positions stay exact;
a batch padded on the left over them is refused (its pads would become sinks).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..kernels.mixed import mixed_attention
from ..numerics.affine import check_finite
from ..methods import MethodSpec, build_quantizers, cache_bytes, family
from ..storage import Rows, held_by_layer, tokens_held
from ..numerics.quantizer import VectorQuantizer
from ..recipe import Recipe
from ..shape import kv_shape
from .attention import register_handler, switch_attention
from .fingerprint import check_recipe
from .kivi import forget, kivi_handler
from .layers import QUANTIZED, WindowCopies, _positions, layer_cos_sin
from .parts import attention_modules, hook_projections, layer_rotaries, layer_windows
from .preflight import preflight


class _Counter:
    """Outliers stored per layer since the last reset, for honest bit accounting: in all, and per token of each
    row (what a sliding-window layer holds is the outliers of its last tokens)."""

    def __init__(self, layers: int):
        self.k = [0] * layers
        self.v = [0] * layers
        self.k_tokens: list[list] = [[] for _ in range(layers)]  # [B, t] per call; None: not known per token
        self.v_tokens: list[list] = [[] for _ in range(layers)]

    def reset(self) -> None:
        layers = len(self.k)
        self.__init__(layers)

    def add(self, kind: str, layer: int, counts: torch.Tensor | int) -> None:
        """Outliers of the tokens just quantized: int64 [B, t], or their number where not known per token."""
        per_token = isinstance(counts, torch.Tensor)
        (self.k if kind == "k" else self.v)[layer] += int(counts.sum()) if per_token else counts
        (self.k_tokens if kind == "k" else self.v_tokens)[layer].append(counts.cpu() if per_token else None)

    def last(self, kind: str, layer: int, tokens: int, held: int) -> int | None:
        """Outliers of the last `held` tokens of every row, where counted per token over exactly `tokens` of them
        (None otherwise)."""
        parts = (self.k_tokens if kind == "k" else self.v_tokens)[layer]
        if not parts or any(p is None for p in parts):
            return None
        counts = torch.cat(parts, dim=1)
        return int(counts[:, -held:].sum()) if counts.shape[1] == tokens else None


def _quantize_tokens(
    q: VectorQuantizer, x: torch.Tensor, start: int, sinks: int
) -> tuple[torch.Tensor, torch.Tensor | int]:
    """Fake-quantize x [B, T, C] whose first token sits at absolute position `start`; sinks stay fp16. Returns
    the outliers kept per token, int64 [B, T] (0 at sinks), or their number where the quantizer cannot say."""
    b, t, c = x.shape
    keep = max(0, min(sinks - start, t))  # leading tokens that are attention sinks
    flat = x[:, keep:].reshape(-1, c)
    if flat.shape[0] == 0:
        return x.half().to(x.dtype), torch.zeros(b, t, dtype=torch.int64)
    rows = getattr(q, "fake_rows", None)
    if rows is not None:
        xq, counts = rows(flat)
        counts = torch.cat([torch.zeros(b, keep, dtype=torch.int64), counts.view(b, t - keep).cpu()], dim=1)
    else:
        xq, n_out = q.fake(flat)
        counts = n_out if n_out else torch.zeros(b, t, dtype=torch.int64)
    xq = xq.view(b, t - keep, c)
    if keep:
        xq = torch.cat([x[:, :keep].half().to(x.dtype), xq], dim=1)
    return xq, counts


SIMULATING = "_kvsqueeze_simulating"  # set on a model while a simulation's hooks are on it: the method's name


class SimulatedLayer(DynamicLayer):
    """A DynamicLayer that quantizes post-RoPE keys [B, H, T, D] as they are appended; for a method with an fp16
    window it also keeps the quantized copies of every key and value (`kq`, `vq`) beside the fp16 ones."""

    def __init__(self, sim: "SimulatedQuantization", layer: int):
        super().__init__()
        self.sim = sim
        self.layer = layer
        self.kq = self.vq = None

    def update(self, key_states, value_states, *args, **kwargs):
        if self.sim.window:  # nuq: keys quantized before RoPE, by the hooks
            return self._update_windowed(key_states, value_states, *args, **kwargs)
        q = self.sim.k_post[self.layer]
        if q is not None:
            b, h, t, d = key_states.shape
            flat = key_states.transpose(1, 2).reshape(b, t, h * d)  # [B, T, H*D]
            xq, n = _quantize_tokens(q, flat, self.get_seq_length(), self.sim.spec.sinks)
            self.sim.counter.add("k", self.layer, n)
            key_states = xq.view(b, t, h, d).transpose(1, 2)
        return super().update(key_states, value_states, *args, **kwargs)

    def _update_windowed(self, key_states, value_states, *args, **kwargs):
        kq, vq = self.sim.quantized_copies(self.layer, key_states, value_states, self.get_seq_length(), kwargs)
        keys, values = super().update(key_states, value_states, *args, **kwargs)  # fp16 copies, turned
        self.kq = kq if self.kq is None else torch.cat([self.kq, kq], dim=2)
        self.vq = vq if self.vq is None else torch.cat([self.vq, vq], dim=2)
        setattr(keys, QUANTIZED, WindowCopies(self.kq, self.vq, False, 0, self.sim.window))
        return keys, values

    # the quantized copies follow every edit of the fp16 ones (crop, beam reorder, batch select / repeat)
    def _follow(self, edit) -> None:
        if self.kq is not None:
            self.kq, self.vq = edit(self.kq), edit(self.vq)

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if self.keys is not None:
            self._follow(lambda x: x[:, :, : self.keys.shape[2]])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._follow(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._follow(lambda x: x[indices, ...])

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._follow(lambda x: x.repeat_interleave(repeats, dim=0))

    def reset(self) -> None:
        super().reset()
        self.kq = self.vq = None


class SimulatedQuantization:
    """Context manager that makes `model` see its KV cache through `spec`'s quantizers.

    Usage::

        with SimulatedQuantization(model, parse_method("nuq3-1%"), recipe) as sim:
            out = model(ids, cache=sim.new_cache(), use_cache=True)
    """

    def __init__(self, model, spec: MethodSpec, recipe: Recipe | None = None):
        self.model = model
        self.spec = spec
        self.recipe = recipe
        self.shape = kv_shape(model.config)
        if recipe is not None:
            check_recipe(recipe, model)
        if spec.reads_model_tensors:  # values (and pre-RoPE keys) read where the model makes them, or a refusal
            preflight(model, keys=spec.pre_rope_keys)
        self.attn = attention_modules(model)
        self.windows = layer_windows(model)  # each layer's sliding window (None: every token)
        qs = [build_quantizers(spec, recipe, i, self.shape.channels, self.shape.head_dim)
              for i in range(self.shape.layers)]
        pre = spec.pre_rope_keys
        self.k_pre = [k if pre else None for k, _ in qs]
        self.k_post = [None if pre else k for k, _ in qs]
        self.v = [v for _, v in qs]
        self.in_attention = family(spec).quantizes_in_attention
        if self.in_attention:
            self.v = [None] * self.shape.layers  # KIVI quantizes K and V in attention (fp16 window)
        # an fp16 window beside the codes (nuq): attention reads recent tokens in fp16, older ones quantized
        self.window = spec.window if family(spec).window_beside_codes else 0
        self.rotary = layer_rotaries(model, self.shape.head_dim) if self.window else None
        self._quantized: dict = {}  # (layer, "k" / "v") -> the last projection's quantized copy [B, T, C]
        self.counter = _Counter(self.shape.layers)
        self._handles: list = []
        self._start = 0
        self._saved_attn = None
        self._marked = False  # whether this simulation set the model's SIMULATING mark

    # ---- hooks ---------------------------------------------------------------------------
    def _model_pre_hook(self, module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        layers = getattr(cache, "layers", None)
        if self.needs_own_cache and not (layers and all(getattr(layer, "sim", None) is self for layer in layers)):
            what = "keeps an fp16 window beside the quantized keys" if self.window else \
                "quantizes keys after RoPE, as its cache takes them"
            raise ValueError(f"method {self.spec.name!r} {what}: the simulation needs its own cache, or those "
                             "keys stay unquantized; pass cache=sim.new_cache() and use_cache=True")
        self._start = cache.get_seq_length() if cache is not None else 0
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        if (self.in_attention and self._start == 0 and isinstance(mask, torch.Tensor) and mask.dim() == 2
                and bool((mask[:, :1] == 0).any())):
            raise ValueError(
                f"method {self.spec.name!r} (KIVI) quantizes keys in groups of tokens counted from the first slot: "
                "a batch padded on the left would put padding in the groups of a row's real tokens, so a row's "
                "result would depend on the rows beside it. Evaluate one sequence at a time (lm-eval: "
                "--batch_size 1) or pad on the right")
        sinks = self.spec.sinks if self.spec.quantized else 0
        if (self._start < sinks and isinstance(mask, torch.Tensor) and mask.dim() == 2
                and bool((mask[:, : sinks - self._start] == 0).any())):
            raise ValueError(
                f"method {self.spec.name!r} keeps the first {sinks} positions as fp16 sinks, and this batch is "
                "padded on the left there: the simulated path would keep padding tokens as sinks and quantize "
                "the rows' real first tokens. Evaluate one sequence at a time, pad on the right, or use the "
                "compressed cache (kvsqueeze.cache_for), which takes each row's first real tokens as its sinks")

    def _quantize_projection(self, layer: int, kind: str, output: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE keys or values as the model makes them, as the quantized cache would give them back."""
        check_finite(output, f"layer {layer} {'key' if kind == 'k' else 'value'} activations")
        q = self.k_pre[layer] if kind == "k" else self.v[layer]
        if q is None:
            return output
        xq, n = _quantize_tokens(q, output.flatten(2), self._start, self.spec.sinks)  # [B, T, C]
        xq = xq.view_as(output)
        self.counter.add(kind, layer, n)
        if not self.window:
            return xq
        self._quantized[layer, kind] = xq.flatten(2)
        return output.half().to(output.dtype)  # the fp16 copy the window holds

    def quantized_copies(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor, start: int,
                         kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The quantized copies [B, H, T, D] of the new keys (post-RoPE) and values of a windowed method: what its
        hooks quantized, the keys turned at the tokens' positions by the layer's rotary module (as the compressed
        cache turns them when it reads them)."""
        b, h, t, d = key_states.shape
        copies = [self._quantized.pop((layer, kind), None) for kind in ("k", "v")]
        if any(c is None or c.shape[1] != t for c in copies):
            raise RuntimeError(f"layer {layer}: the keys and values entering the cache were not made by this "
                               f"forward's projections, so their quantized copies for {self.spec.name!r}'s fp16 "
                               "window are unknown; fill the cache through the model's forward")
        keys = copies[0].view(b, t, h, d).transpose(1, 2).to(key_states.dtype)
        extra = kwargs.get("kwargs") or {}
        pos = _positions(extra.get("position_ids", kwargs.get("position_ids")), b, t, start, key_states.device)
        rot = self.rotary[layer]
        kq = rot.apply(keys, layer_cos_sin(rot, pos, key_states.dtype))
        return kq, copies[1].view(b, t, h, d).transpose(1, 2).to(value_states.dtype)

    @property
    def needs_own_cache(self) -> bool:
        """Whether part of the method happens as its cache takes the keys (`new_cache`): post-RoPE keys, or the
        quantized copies beside an fp16 window; the other methods act in the model's projections alone."""
        return bool(self.window) or any(q is not None for q in self.k_post)

    def __enter__(self) -> "SimulatedQuantization":
        active = getattr(self.model, SIMULATING, None)
        if active is not None:
            raise RuntimeError(f"a simulation of {active!r} is already active on this model; leave it first")
        setattr(self.model, SIMULATING, self.spec.name)
        self._marked = True
        try:
            self._handles.append(self.model.register_forward_pre_hook(self._model_pre_hook, with_kwargs=True))
            self._handles += hook_projections(self.model, self._quantize_projection)
            if self.in_attention:
                register_handler(kivi_handler)
                self._saved_attn = switch_attention(self.model)
                for a in self.attn:
                    a.kvsqueeze_kivi = self.spec
            elif self.window:
                register_handler(window_handler)
                self._saved_attn = switch_attention(self.model)
                for a in self.attn:
                    a.kvsqueeze_window = self.window
        except BaseException:  # a refusal half-way leaves no hooks and no mark on the model
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self._marked:  # the mark this simulation set, not another's
            delattr(self.model, SIMULATING)
            self._marked = False
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._quantized.clear()
        if self._saved_attn is not None:
            self.model.set_attn_implementation(self._saved_attn)
            for a in self.attn:
                a.__dict__.pop("kvsqueeze_kivi", None)
                a.__dict__.pop("kvsqueeze_window", None)
            forget(self.attn)
            self._saved_attn = None

    # ---- caches and accounting -----------------------------------------------------------
    def new_cache(self) -> Cache:
        """A fresh cache for one batch of sequences (post-RoPE keys are quantized on entry)."""
        self.counter.reset()
        for q in (*self.k_pre, *self.k_post, *self.v):
            if hasattr(q, "reset"):
                q.reset()  # a quantizer that adapts to a prompt (turbo's split) starts over
        return Cache(layers=[SimulatedLayer(self, i) for i in range(self.shape.layers)])

    def held(self, tokens: int) -> list[int | None]:
        """Tokens each layer holds of a row of `tokens` (`storage.held_by_layer`: None for all of them)."""
        return held_by_layer(self.windows, tokens)

    def elements(self, tokens: int, batch: int = 1) -> int:
        """K and V elements the cache holds for `batch` rows of `tokens` tokens (what bits per element divide by)."""
        return 2 * batch * self.shape.channels * tokens_held(self.held(tokens), tokens, self.shape.layers)

    def storage(self, tokens: int, batch: int = 1) -> dict[str, float]:
        """Bytes the cache holds for `batch` rows of `tokens` tokens, by component, with the outliers this
        simulation kept (the method's `cache_bytes`: for a method the compressed cache holds, what its memory
        report would say). A sliding-window layer holds its last window - 1 tokens and the outliers kept among
        them (where not counted per token, its share of those kept over every token)."""
        shape = self.shape
        held = self.held(tokens)

        def kept(kind: str, i: int, h: int | None) -> int:
            n = (self.counter.k if kind == "k" else self.counter.v)[i]
            if h is None:
                return n
            last = self.counter.last(kind, i, tokens, h)
            return last if last is not None else round(n * h / max(tokens, 1))

        outliers = [(kept("k", i, h), kept("v", i, h)) for i, h in enumerate(held)]
        return cache_bytes(self.spec, shape.layers, shape.channels, shape.head_dim, Rows(tokens, (0,) * batch),
                           self.recipe, held=held, outliers=outliers)


def window_handler(module, query, key, value, attention_mask, scaling, **kwargs):
    """The "kvsqueeze" attention handler for keys that carry a second copy (`QUANTIZED`, a `WindowCopies`: a
    simulated or compressed layer of a windowed nuq method): each query reads its window's fp16 keys and values
    and the quantized copies of older ones. A module of a windowed simulation whose keys carry none is an error."""
    copies = getattr(key, QUANTIZED, None)
    if copies is None:
        if getattr(module, "kvsqueeze_window", None) is not None and key.shape[2] > 0:  # not a fused-decode marker
            raise RuntimeError(f"{type(module).__name__}: the keys reaching attention did not come from a simulated "
                               "cache of this method, so their quantized copies are missing; build the cache with "
                               "`sim.new_cache()` and pass it to the forward")
        return None
    if copies.k.shape[:2] != key.shape[:2] or copies.start + copies.k.shape[2] != key.shape[2]:
        raise RuntimeError(f"{type(module).__name__}: {'exact' if copies.exact else 'quantized'} copies "
                           f"{tuple(copies.k.shape)} from position {copies.start} for keys {tuple(key.shape)}; the "
                           "keys were changed after the cache returned them")
    exact, quantized = ((copies.k, copies.v), (key, value)) if copies.exact else ((key, value), (copies.k, copies.v))
    return mixed_attention(query, *exact, *quantized, attention_mask, scaling, copies.window,
                           softcap=kwargs.get("softcap"), sink_logits=kwargs.get("s_aux"), start=copies.start)
