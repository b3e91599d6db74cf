"""kvsqueeze as a vLLM attention backend: KVQuant's compressed cache in vLLM's paged KV memory.

Installed with kvsqueeze, the `vllm.general_plugins` entry point `kvsqueeze` runs `register` in every vLLM process
(front end, engine core, workers). It registers `KVSqueezeBackend` in vLLM's `CUSTOM` backend slot; selecting
that slot serves the model with a compressed cache:

    KVSQUEEZE_RECIPE=out/recipe vllm serve MODEL_DIR --attention-backend CUSTOM
    LLM(model=MODEL_DIR, attention_backend="CUSTOM")        # with KVSQUEEZE_RECIPE in the environment

(`kvsqueeze.serving.settings` lists the settings.) vLLM's CPU platform picks its own backend whatever is asked
for; `register` makes it honour a CUSTOM choice, and nothing else changes.

What the backend does, per layer and step:

* each layer's KV spec gets that layer's `PageLayout.page_bytes / block_size` uint8 bytes per token (a bit budget's
  layers differ in size; `_size_pages_per_layer`), so vLLM's allocator sizes, counts and hands out pages of the
  compressed layout (`kvsqueeze.paged.layout`).
* vLLM hands the attention post-RoPE keys. `register` also wraps vLLM's rotary step so that it keeps the keys it
  is about to turn; the attention takes those (after checking that they are this layer's: turned back, the keys
  it was handed must give them), and otherwise turns the keys back by their positions (the layer's RoPE, from the
  model config, checked at the first step against the cos / sin table of every rotary module vLLM built).
  Either way the pre-RoPE keys are quantized with the values into their slots of the pages.
* the checkpoint's key projections are hashed as vLLM's loader streams them and checked against the recipe's
  fingerprint (`KeyWeights`), as the HF path checks the model's: a fine-tune of the same shape is refused.
* every query then attends over its sequence's pages: decode tokens of the whole batch in one call of the fused
  kernel (numba on CPU, Triton on GPU, each reading every token's slot in its page through the block tables);
  prefill chunks (prompts, later chunks of a chunked prefill, and prompts whose prefix vLLM found
  cached) over the pages dequantized through the sequence's block table (`PageLayout.read`) with a causal mask.
  That is what kvsqueeze's own HF path computes: its prefill also attends the quantized cache. Pages in CPU
  memory are written and read by numba kernels (`kvsqueeze.kernels.numba.pages`), loaded at start-up.
* a method with an fp16 window (`:rN`) also writes every token's fp16 keys and values into the window's own
  pages (`WindowStore`, a sliding-window KV group vLLM frees as tokens leave the window), and each query reads
  its last N tokens from there, exact, and older ones from the codes.

Tensor parallelism: each rank holds its share of the KV heads (`PageLayout`'s `heads`). A token's values are
quantized over all its KV heads (one scale, zero-point and top-k per token) and its exact key elements chosen over all
its channels, so the ranks exchange the new tokens' pre-RoPE keys and values (one all-gather per layer and step) and
each encodes whole tokens as one rank would, keeping its heads' share: every rank's pages are bit for bit the
matching part of what one rank would hold, and attention over them is the same.

Refused at start-up with the reason: a tensor-parallel size that does not divide the model's KV heads, pipeline
parallelism or a disabled hybrid KV cache manager with an fp16 window, the model's own sliding windows,
ALiBi, learned attention sinks, encoder attention, KV sharing across layers, interleaved (GPT-J) RoPE, RoPE
scalings whose frequencies change with the length.
"""

from __future__ import annotations

import re
import sys
import weakref
from dataclasses import dataclass, field, replace
from typing import ClassVar

import numpy as np
import torch

from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import (AttentionBackend, AttentionImpl, AttentionMetadata, AttentionMetadataBuilder,
                                       AttentionType, CommonAttentionMetadata, MultipleOf)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout, SlidingWindowSpec

from ..kernels import decode_attention
from ..kernels.mixed import mixed_attention
from ..numerics.rope import Rope, apply_rope
from .settings import ServingConfig, ServingError, numba_for_engine, window_page_tokens

BACKEND_PATH = "kvsqueeze.serving.vllm.KVSqueezeBackend"


def register() -> None:
    """The `vllm.general_plugins` entry point: put the backend in the CUSTOM slot (and let CPU honour it)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    numba_for_engine()
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    _keep_pre_rope_keys()
    _size_pages_per_layer()
    _check_key_weights_as_loaded()
    try:
        from vllm.platforms.cpu import CpuPlatform
    except ImportError:  # a build without the CPU platform
        return
    _wrap_once(CpuPlatform, "get_attn_backend_cls", _honour_custom)
    _wrap_once(CpuPlatform, "register_triton_kernel_overrides", _explain_kernel_overrides)


def _wrap_once(platform, name: str, wrap) -> None:
    """Replace the classmethod `name` of `platform` by `wrap(its function)`, once per process (a second
    registration, or a platform without it, leaves it as it is)."""
    current = getattr(platform, name, None)
    if current is None or getattr(current, "_kvsqueeze", False):
        return
    wrapped = wrap(current.__func__)
    wrapped._kvsqueeze = True
    setattr(platform, name, classmethod(wrapped))


def _honour_custom(original):
    """The CPU platform's backend choice, which otherwise ignores the CUSTOM slot, made to take it."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if selected_backend == AttentionBackendEnum.CUSTOM and not attn_selector_config.use_mla:
            # what vLLM's GPU platforms ask of a selected backend, asked here too: a configuration it cannot
            # serve (non-causal or multimodal-prefix attention, batch invariance, ...) is refused, not run causal
            reasons = AttentionBackendEnum.CUSTOM.get_class().validate_configuration(
                device_capability=cls.get_device_capability(), **attn_selector_config._asdict())
            if reasons:
                raise ServingError(f"the kvsqueeze attention backend cannot serve this model's attention: "
                                   f"{'; '.join(reasons)}; serve it with vLLM's own backend")
            return AttentionBackendEnum.CUSTOM.get_path()
        return original(cls, selected_backend, attn_selector_config, num_heads)

    return get_attn_backend_cls


def _explain_kernel_overrides(original):
    """vLLM's CPU worker replaces Triton kernels by scanning the attributes of every loaded module, and the scan
    fails on an object of numba's compiler (llvmlite) when numba was imported first, with vLLM's own backend as
    with this one: a bare AttributeError from inside the worker. Said in words, with the fix, instead."""

    def register_triton_kernel_overrides(cls):
        try:
            return original(cls)
        except AttributeError as exc:
            if "numba" not in sys.modules:
                raise
            raise ServingError("vLLM's CPU worker could not set up its kernels because numba was imported in this "
                               "process before the engine was built (kvsqueeze's CPU kernels import it; so does "
                               f"its HF path), and vLLM's search for the Triton kernels it replaces fails on one of "
                               f"numba's objects ({exc}); build the engine before using numba in the same process, "
                               "or run it in a process of its own (python -m kvsqueeze.serving.vllm_run)") from exc

    return register_triton_kernel_overrides


class PreRopeKeys:
    """The keys vLLM's rotary step was last given, before it turned them (in place, on CPU).

    A decoder layer runs its rotary step and then its attention, so the attention of the same layer finds its own
    keys here. Kept only once a kvsqueeze attention exists and never while torch compiles a graph; `take` hands
    them over once."""

    enabled = False
    keys: torch.Tensor | None = None

    @classmethod
    def keep(cls, key: torch.Tensor | None) -> None:
        if cls.enabled and key is not None and not torch.compiler.is_compiling():
            cls.keys = key.detach().clone()

    @classmethod
    def take(cls) -> torch.Tensor | None:
        keys, cls.keys = cls.keys, None
        return keys


# vLLM's rotary modules built in this process, and those that have turned keys since the model being served
# was built (vLLM keeps rotary modules of earlier engines, whose RoPE may differ): the backend checks its own
# RoPE against the second, or against the first when none ran through a method it wraps
_ROTARIES: weakref.WeakSet = weakref.WeakSet()
_ROTARIES_RUN: weakref.WeakSet = weakref.WeakSet()


def _keep_pre_rope_keys() -> None:
    """Wrap vLLM's rotary step (each of its implementations) to keep the keys it is given (`PreRopeKeys`), and its
    constructor to note every rotary module built (`_ROTARIES`)."""
    try:
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding, RotaryEmbeddingBase
    except ImportError:  # another layout of vLLM: nothing noted, and the backend refuses to serve (`_check_rotary`)
        return
    init = RotaryEmbeddingBase.__init__
    if not getattr(init, "_kvsqueeze", False):
        def __init__(self, *args, _original=init, **kwargs):
            _original(self, *args, **kwargs)
            _ROTARIES.add(self)

        __init__._kvsqueeze = True
        RotaryEmbeddingBase.__init__ = __init__
    for name in ("forward_native", "forward_cpu", "forward_cuda"):
        original = getattr(RotaryEmbedding, name, None)
        if original is None or getattr(original, "_kvsqueeze", False):
            continue

        def forward(self, positions, query, key=None, *args, _original=original, **kwargs):
            PreRopeKeys.keep(key)
            _ROTARIES_RUN.add(self)
            return _original(self, positions, query, key, *args, **kwargs)

        forward._kvsqueeze = True
        setattr(RotaryEmbedding, name, forward)


class KeyWeights:
    """The recipe's fingerprint, and whether the key weights vLLM loaded were checked against it.

    The engine's attention holds no weights; the checkpoint's key projections pass by as vLLM's default loader
    streams the checkpoint (HF names, whole tensors, before any sharding), and each is hashed and probed as the
    HF path's `check_recipe` does with the model's. `checked` is cleared as each kvsqueeze attention is built
    (a new engine's model), and set once its weights have passed."""

    checked = False

    NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.k_proj\.weight$")
    QUANTIZED = re.compile(r"\.k_proj\.(qweight|qzeros|scales|weight_packed|weight_scale|weight_zero_point|absmax)$")

    @staticmethod
    def recipe_of(model):
        """The recipe of the kvsqueeze attention in `model` (None: vLLM's own backend serves it)."""
        for module in model.modules():
            impl = getattr(module, "impl", None)
            if isinstance(impl, KVSqueezeImpl):
                return impl.config._recipe
        return None

    @classmethod
    def check(cls, recipe, found: dict[int, list[tuple[str, tuple[str, list[float]]]]],
              probes: dict[str, list[float]] | None = None, refused: str | None = None) -> None:
        """Compare the streamed key projections (`found`: by layer, each (checkpoint name, `key_digest`)) and
        tensor probes (by checkpoint name) with `recipe`'s fingerprint; `refused`: why the stream cannot be
        compared at all (a quantized checkpoint), said before anything else."""
        from ..recipe import other_tensors, same_weights

        want = recipe.meta["model"]["fingerprint"]
        model = recipe.meta["model"].get("id")
        if refused:
            raise ServingError(f"{refused}: kvsqueeze checks the key weights against those the recipe was calibrated "
                               f"on ({model!r}) and quantizes the keys they make; serve an unquantized checkpoint "
                               "(fp32, bf16 or fp16), or this one with vLLM's own backend")
        named = set(want.get("weights_probe") or ())
        digests = {}
        for layer, hits in found.items():
            if len(hits) > 1:  # another tower's layers (a vision encoder): the recipe's own names pick the model's
                hits = [h for h in hits if h[0] in named]
            if len(hits) != 1:
                names = ", ".join(h[0] for h in found[layer][:3])
                raise ServingError(f"the checkpoint holds several key projections for layer {layer} ({names}) and "
                                   "the recipe names none or several of them: kvsqueeze cannot tell which is the "
                                   f"model its recipe was calibrated on ({model!r}); serve it with vLLM's own backend")
            digests[layer] = hits[0][1]
        layers = int(want["layers"])
        if sorted(digests) != list(range(layers)):
            raise ServingError(f"the checkpoint's key projections (layers.N.self_attn.k_proj.weight) came for layers "
                               f"{sorted(digests)[:8]}, not for each of the recipe's {layers}: kvsqueeze cannot check "
                               f"that it is the model the recipe was calibrated on ({model!r}); serve a checkpoint "
                               "with one k_proj per layer, or with vLLM's own backend")
        have = {"layers_sha256": [digests[i][0] for i in range(layers)],
                "layers_probe": [digests[i][1] for i in range(layers)]}
        wrong = same_weights(want, have)
        if wrong:
            shown = ", ".join(map(str, wrong[:8])) + (" ..." if len(wrong) > 8 else "")
            raise ServingError(f"recipe was calibrated on model {model!r}, not on this one: the key weights of "
                               f"layer(s) {shown} differ by more than a change of precision would (a fine-tune or "
                               "another model of the same shape); calibrate one for this model with "
                               "`kvsqueeze calibrate --model ... --out DIR`")
        if isinstance(want.get("weights_probe"), dict) and probes is not None:
            shared = named & set(probes)
            if 2 * len(shared) < len(named):  # a tied head may be missing; most of the model may not
                missing = sorted(named - set(probes))
                raise ServingError(f"the checkpoint names {len(shared)} of the {len(named)} tensors the recipe probed "
                                   f"(missing e.g. {', '.join(missing[:3])}): kvsqueeze cannot check that it is the "
                                   f"model the recipe was calibrated on ({model!r}); serve the checkpoint the recipe "
                                   "was calibrated from, or this one with vLLM's own backend")
            others = other_tensors(want["weights_probe"], probes)
            if others:
                shown = ", ".join(others[:4]) + (f" and {len(others) - 4} more" if len(others) > 4 else "")
                raise ServingError(f"recipe was calibrated on model {model!r}, not on this one: the weights of "
                                   f"{shown} differ by more than a change of precision would (a fine-tune of it); "
                                   "calibrate one for this model with `kvsqueeze calibrate --model ... --out DIR`")
        cls.checked = True


FLOAT_WEIGHTS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # weights kvsqueeze can check


def _check_key_weights_as_loaded() -> None:
    """Wrap vLLM's default loader's weight stream so that, with a kvsqueeze attention in the model, the key
    projections' weights are checked against the recipe's fingerprint as they load (`KeyWeights`)."""
    try:
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    except ImportError:  # another layout of vLLM: nothing is checked, and the backend refuses at its first step
        return
    original = DefaultModelLoader.get_all_weights
    if getattr(original, "_kvsqueeze", False):
        return

    def get_all_weights(self, model_config, model):
        recipe = KeyWeights.recipe_of(model)
        if recipe is None:
            yield from original(self, model_config, model)
            return
        from ..recipe import key_digest, tensor_probe

        found, probes, refused = {}, {}, None
        for name, tensor in original(self, model_config, model):
            hit = KeyWeights.NAME.search(name)
            if hit:
                found.setdefault(int(hit.group(1)), []).append((name, key_digest(int(hit.group(1)), tensor)))
            if refused is None and KeyWeights.QUANTIZED.search(name):
                refused = f"the checkpoint is quantized ({name})"
            elif refused is None and tensor.is_floating_point() and tensor.dtype not in FLOAT_WEIGHTS:
                refused = f"the checkpoint holds {name} in {str(tensor.dtype).replace('torch.', '')}"
            probes[name] = tensor_probe(tensor)
            yield name, tensor
        KeyWeights.check(recipe, found, probes, refused)

    get_all_weights._kvsqueeze = True
    DefaultModelLoader.get_all_weights = get_all_weights


def _size_pages_per_layer() -> None:
    """Wrap vLLM's `Attention.get_kv_cache_spec` so that each kvsqueeze layer's spec carries that layer's page size:
    a bit budget gives layers different widths and outliers, so different bytes per token. vLLM keeps layers whose
    specs differ only in size in one group, each with its own pages (`UniformTypeKVCacheSpecs`), all with the same
    number of blocks."""
    try:
        from vllm.model_executor.layers.attention.attention import Attention
    except ImportError:
        return
    original = Attention.get_kv_cache_spec
    if getattr(original, "_kvsqueeze", False):
        return

    def get_kv_cache_spec(self, vllm_config):
        spec = original(self, vllm_config)
        backend = getattr(self, "attn_backend", None)
        if isinstance(spec, AttentionSpec) and isinstance(backend, type) and issubclass(backend, KVSqueezeBackend):
            spec = KVSqueezeBackend.layer_spec(spec, self.layer_name, vllm_config)
        return spec

    get_kv_cache_spec._kvsqueeze = True
    Attention.get_kv_cache_spec = get_kv_cache_spec


def _tensor_parallel(vllm_config, what: str) -> tuple[int, int]:
    """(this process's tensor-parallel rank, the number of ranks), refused unless the number is the engine's
    --tensor-parallel-size (a process where vLLM's groups are not set up sees one rank)."""
    from vllm.distributed import parallel_state

    rank, ranks = 0, 1
    if parallel_state.model_parallel_is_initialized():
        rank, ranks = (parallel_state.get_tensor_model_parallel_rank(),
                       parallel_state.get_tensor_model_parallel_world_size())
    tp = int(getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", ranks) or 1)
    if ranks != tp:
        raise ServingError(f"--tensor-parallel-size {tp}, but the process {what} sees {ranks} tensor-parallel "
                           "ranks: the kvsqueeze backend runs in vLLM's workers")
    return rank, ranks


def _layer_index(name: str) -> int:
    m = _LAYER_INDEX.search(name)
    if m is None:
        raise ServingError(f"cannot tell the decoder layer of attention {name!r}: its recipe statistics are per layer")
    return int(m[1])


class KVSqueezeBackend(AttentionBackend):
    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = True  # forward quantizes the new tokens: it knows their positions
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[KVSqueezeImpl]:
        return KVSqueezeImpl

    @staticmethod
    def get_builder_cls() -> type[KVSqueezeMetadataBuilder]:
        return KVSqueezeMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        """Each layer's pages one after another; with a window, blocks outermost, so that vLLM can keep the
        window's pages (a group of their own, `WindowStore`) in the same blocks as the layers' pages."""
        return (KVCacheLayout.BLHNC,) if ServingConfig.from_env().spec.window else (KVCacheLayout.LBHNC,)

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def layer_spec(cls, spec: AttentionSpec, layer_name: str, vllm_config=None) -> AttentionSpec:
        """One page of `block_size` tokens of this layer holds its compressed layout: uint8, the layer's
        `page_bytes / block_size` a token."""
        rank, ranks = _tensor_parallel(vllm_config, f"sizing {layer_name}'s pages")
        channels = spec.num_kv_heads * ranks * spec.head_size  # the model's: a rank's spec counts its own heads
        per_token = ServingConfig.from_env().page_bytes(_layer_index(layer_name), channels, spec.block_size,
                                                         spec.head_size, rank, ranks) // spec.block_size
        return replace(spec, dtype=torch.uint8, num_head_slots=1, state_content_bytes=per_token)

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """The layer's spec as `layer_spec` sized it (vLLM asks without naming the layer)."""
        if spec.state_content_bytes is None:
            raise ServingError("the kvsqueeze backend sizes each layer's pages from its layer name, and this vLLM "
                               "asked for a KV spec without it (Attention.get_kv_cache_spec was not wrapped); "
                               "serve with the vLLM version kvsqueeze pins")
        return spec


@dataclass
class KVSqueezeMetadata(AttentionMetadata):
    num_actual_tokens: int
    query_start_loc_cpu: torch.Tensor  # int32 [R + 1]
    seq_lens_cpu: torch.Tensor  # int32 [R], the new tokens included
    block_table: torch.Tensor  # int32 [R, max blocks]
    slot_mapping: torch.Tensor  # int64 [N]
    positions: torch.Tensor  # int64 [N]
    decode: torch.Tensor  # int64 [D]: the requests with one new token
    lead: bool  # the decode requests are the first D (the builder asks vLLM to put them first)
    decode_table: torch.Tensor  # int32 [D, max blocks]: their block tables
    decode_lens: torch.Tensor  # int64 [D]: their lengths
    prefill: tuple[int, ...]  # the requests with more than one new token
    memo: dict = field(default_factory=dict)  # what every layer of this step derives alike (`PageLayout.view`)


def _decode_rows(x: torch.Tensor, index: torch.Tensor, lead: bool) -> torch.Tensor:
    """The rows of `x` at `index` (the decode requests', or their tokens'): its first len(index) rows when the
    decode requests lead the batch, without gathering them."""
    return x[:index.numel()] if lead else x[index]


class KVSqueezeMetadataBuilder(AttentionMetadataBuilder[KVSqueezeMetadata]):
    # (the step's common metadata, what was built from it), shared by every builder: layers whose pages differ in
    # size (a budget's per-layer widths) fall in attention groups of their own, each with its own builder, which
    # the engine hands the same common metadata within a step; one metadata, and one memo, then serves them all
    _last: tuple[CommonAttentionMetadata, KVSqueezeMetadata] | None = None

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)  # decodes first

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KVSqueezeMetadata:
        m = common_attn_metadata
        last = KVSqueezeMetadataBuilder._last
        if last is not None and last[0] is m:  # built from nothing but `m`: the same for every attention group
            return last[1]
        n = m.num_actual_tokens
        qsl = m.query_start_loc_cpu[: m.num_reqs + 1].to(torch.int64)
        lens = m.seq_lens[: m.num_reqs].to("cpu", torch.int64)
        qlens = qsl.diff()
        if m.positions is not None:
            positions = m.positions[:n].to(torch.int64).clone()
        else:  # token j of request r sits at (seq_len - query_len) + j
            starts = torch.repeat_interleave(lens - qlens, qlens)
            offsets = torch.arange(int(qsl[-1])) - torch.repeat_interleave(qsl[:-1], qlens)
            positions = (starts + offsets)[:n].to(m.slot_mapping.device)
        table = m.block_table_tensor[: m.num_reqs]
        decode = (qlens == 1).nonzero().flatten()
        nd = decode.numel()
        lead = nd == 0 or int(decode[-1]) == nd - 1
        md = KVSqueezeMetadata(n, qsl, lens, table, m.slot_mapping[:n], positions, decode, lead,
                               _decode_rows(table, decode, lead), _decode_rows(lens, decode, lead),
                               tuple((qlens > 1).nonzero().flatten().tolist()))
        KVSqueezeMetadataBuilder._last = (m, md)  # held: its id cannot name another object while it is
        return md


class KVSqueezeWindowBackend(KVSqueezeBackend):
    """The backend of the fp16 window's pages (`WindowStore`): no attention of its own (the layers' attention
    writes and reads the window), only the metadata of its KV group (that group's block table and slot mapping)."""

    @staticmethod
    def get_name() -> str:
        return "KVSQUEEZE_WINDOW"

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.BLHNC,)


class WindowStore(torch.nn.Module, AttentionLayerBase):
    """The fp16 window of a method with one (`:rN`): every sequence's N most recent tokens, exact, beside their
    codes in the layers' pages (the HF store holds the same: codes for every token, the window's fp16 copies
    besides).

    One extra layer of the engine holds it for all layers: a token's entry is its pre-RoPE keys and values in
    fp16 for every decoder layer ([layers, 2, C]), in pages of `block_size` tokens that vLLM manages as a sliding
    window layer's (`SlidingWindowSpec` of N tokens). So vLLM keeps a sequence's last N tokens' pages and frees
    older ones, counts them in its admission and its memory, caches them with a prefix (a prefix hit brings the
    window of its last tokens) and frees them with the sequence; a preempted sequence writes its window again
    when it is prefilled again. Every token a step computes is written (vLLM may cache any page of the window
    group); attention reads only a query's last N positions.

    What it costs: a sequence holds about ceil((N - 1 + tokens in flight) / block_size) + 1 window pages, each
    of `block_size` x layers x 2 x C x 2 bytes, out of the same blocks as the layers' pages (vLLM packs the two
    groups into one pool of blocks of the larger of the two block sizes in bytes).
    """

    def __init__(self, name: str, layers: int, heads: int, head_size: int, window: int, block_size: int):
        super().__init__()
        self.layer_name, self.layers, self.heads, self.head_size = name, layers, heads, head_size
        self.window, self.block_size = window, block_size
        self.channels = heads * head_size
        self.token_bytes = layers * 2 * self.channels * 2
        self.kv_cache = torch.tensor([])
        vllm_config = get_current_vllm_config()
        vllm_config.compilation_config.static_forward_context[name] = self

    def get_attn_backend(self) -> type[AttentionBackend]:
        return KVSqueezeWindowBackend

    def get_kv_cache_spec(self, vllm_config) -> SlidingWindowSpec:
        if getattr(vllm_config.scheduler_config, "disable_hybrid_kv_cache_manager", False):
            raise ServingError(f"{ServingConfig.from_env().spec.name} keeps the {self.window} most recent tokens of "
                               "every sequence in fp16, in pages vLLM frees as they leave the window; with the hybrid "
                               "KV cache manager disabled (--disable-hybrid-kv-cache-manager, or a KV connector "
                               "without it) vLLM would keep every token's fp16 copy. Serve with the hybrid manager "
                               "and no KV connector, or a method without a window (drop ':r"
                               f"{self.window}')")
        spec = SlidingWindowSpec(block_size=self.block_size, num_kv_heads=self.heads, head_size=self.head_size,
                                 dtype=torch.uint8, num_head_slots=1, state_content_bytes=self.token_bytes,
                                 sliding_window=self.window)
        chunk = int(vllm_config.scheduler_config.max_num_batched_tokens)
        longest = int(vllm_config.model_config.max_model_len)
        reserved = spec.max_admission_blocks_per_request(int(vllm_config.max_in_flight_tokens), longest)
        logger.info("kvsqueeze: %s keeps each sequence's last %d tokens in fp16 pages of %d tokens; a request "
                    "prefilling holds up to %d of them (%d tokens a step, --max-num-batched-tokens), a decoding one "
                    "%d. Each takes a whole block of the KV space: a smaller prefill chunk admits more requests at "
                    "once.", ServingConfig.from_env().spec.name, self.window, self.block_size, reserved, chunk,
                    spec.max_admission_blocks_per_request(1, longest))  # a decode step: one token in flight
        return spec

    def tokens(self) -> torch.Tensor:
        """The window's pages as float16 [blocks, block_size, layers, 2 (keys, values), C]."""
        cache = self.kv_cache
        return cache.view(torch.float16).view(cache.shape[0], self.block_size, self.layers, 2, self.channels)

    @staticmethod
    def slots(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Page and offset of each position [R, W] (>= 0) of each row's window table [R, blocks]."""
        page = torch.gather(table.to(torch.int64), 1, positions // block_size)
        return page, positions % block_size


logger = init_logger(__name__)
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


# families whose vLLM models turn keys rotate-half style (neox), as the kernels turn them back; every rotary module
# vLLM builds is also checked against the backend's RoPE before the first step (`_check_rotary`)
ROTATE_HALF_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def _rope(hf_config, head_dim: int) -> Rope:
    """The layer's RoPE frequencies from the model config (plain, or a static rescaling transformers knows)."""
    if hf_config.model_type not in ROTATE_HALF_FAMILIES:
        families = ", ".join(ROTATE_HALF_FAMILIES)
        raise ServingError(f"{hf_config.model_type}: the kvsqueeze vLLM backend serves {families} (keys turned "
                           "rotate-half, checked against kvsqueeze's HF path); serve this family with kvsqueeze's HF "
                           "path or vLLM's own backend")
    if getattr(hf_config, "rope_interleaved", False) or getattr(hf_config, "rotary_interleaved", False):
        raise ServingError(f"{hf_config.model_type}: interleaved (GPT-J) RoPE pairs; kvsqueeze turns rotate-half pairs")
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ServingError(f"{hf_config.model_type}: RoPE differs by layer type ({', '.join(params)}); the vLLM "
                           "backend serves one RoPE for every layer")
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    rotary = int(head_dim * float(getattr(hf_config, "partial_rotary_factor", None) or 1.0))  # None: every channel
    if kind == "default":  # in float32, as vLLM (and transformers) compute them: the keys were turned by these
        return Rope(1.0 / (theta ** (torch.arange(0, rotary, 2, dtype=torch.float32) / rotary)))
    if kind in ("dynamic", "longrope"):
        raise ServingError(f"{hf_config.model_type}: RoPE '{kind}' changes its frequencies with the sequence length; "
                           "a cache that turns keys at read time cannot reproduce it")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # vLLM's own transformers

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu")
    return Rope(inv_freq.float().cpu(), float(scaling))


# the (RoPE, head size) pairs each rotary module was checked against; by the module itself, not its id, which a
# module built later at a dead one's address would share
_ROTARIES_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _check_rotary(rope: Rope, head_size: int) -> None:
    """Refuse to serve unless every rotary module vLLM built turns a head's keys and queries as `rope` does: the
    same rotary width, rotate-half pairs and cos / sin at every position of its table (to the rounding of the
    table's dtype). The pages hold keys before RoPE and the kernels turn them by `rope` at read time against
    queries vLLM's rotary step turned, so any difference would change every attention score without an error.
    Checked once per module and RoPE, at a layer's first step (the model is built by then)."""
    rotaries = list(_ROTARIES_RUN) or list(_ROTARIES)
    if not rotaries:
        raise ServingError("the kvsqueeze backend found no vLLM rotary module to check its RoPE against (a model "
                           "without RoPE, or a vLLM whose rotary modules it does not know); serve this model with "
                           "vLLM's own backend")
    for rotary in rotaries:
        memo = (rope.key, head_size)
        if memo in _ROTARIES_CHECKED.get(rotary, ()):
            continue
        name = type(rotary).__name__
        cache = getattr(rotary, "cos_sin_cache", None)
        width = getattr(rotary, "rotary_dim", None)
        if not isinstance(cache, torch.Tensor) or not getattr(rotary, "is_neox_style", False):
            how = "without a cos / sin table" if cache is None else "in interleaved (GPT-J) pairs"
            raise ServingError(f"vLLM's rotary module {name} turns keys {how}; kvsqueeze turns rotate-half pairs "
                               "by a cos / sin table, so its scores would differ; serve this model with vLLM's own "
                               "backend")
        if getattr(rotary, "head_size", head_size) != head_size or width != rope.rotary_dim:
            raise ServingError(f"vLLM's rotary module {name} turns {width} of {rotary.head_size} channels a head, "
                               f"kvsqueeze's RoPE from the model config {rope.rotary_dim} of {head_size}; serve this "
                               "model with vLLM's own backend")
        table = cache.detach().float().cpu()
        cos, sin = rope.cos_sin(torch.arange(table.shape[0]), float32_angles=True)  # vLLM's angles: float32
        # the table's rounding, plus what a frequency one or two float32 ulps off (another device's powf) turns
        # into at each position: up to 2**-22 of the angle
        angle = torch.arange(table.shape[0], dtype=torch.float64).view(-1, 1) * rope.inv_freq.double().view(1, -1)
        tol = 2 * torch.finfo(cache.dtype).eps * max(1.0, rope.scaling) + 1e-5 + 2.0**-22 * angle
        over = torch.maximum((table[:, :rope.half] - cos).abs() - tol, (table[:, rope.half:] - sin).abs() - tol)
        err = max(float((table[:, :rope.half] - cos).abs().max()), float((table[:, rope.half:] - sin).abs().max()))
        if float(over.max()) > 0:
            raise ServingError(f"vLLM's rotary module {name} turns keys by other angles than kvsqueeze's RoPE from the "
                               f"model config (cos / sin differ by up to {err:.3g} over {table.shape[0]} positions); "
                               "serve this model with vLLM's own backend")
        _ROTARIES_CHECKED.setdefault(rotary, set()).add(memo)


def _words(store: torch.Tensor) -> np.ndarray:
    """The window's pages (`WindowStore.tokens`) as one flat run of 16-bit words (int16), from the first page's
    first entry to the last page's last: the buffer the compiled window reads and writes address."""
    flat = store.as_strided(((store.shape[0] - 1) * store.stride(0) + store[0].numel(),), (1,))
    return flat.view(torch.int16).numpy()


def _host(x: torch.Tensor) -> np.ndarray:
    """A CPU float32 tensor [N, C] as a C-contiguous numpy array (no copy when it is one already)."""
    return np.ascontiguousarray(x.to(torch.float32).numpy())


class KVSqueezeImpl(AttentionImpl[KVSqueezeMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes=None, sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, **kwargs):
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.softcap = logits_soft_cap or None
        vllm_config = get_current_vllm_config()
        hf = vllm_config.model_config.hf_text_config
        what = {"a sliding window": sliding_window, "ALiBi": alibi_slopes, "learned attention sinks":
                kwargs.get("sinks"), "KV sharing across layers": kv_sharing_target_layer_name,
                "encoder attention": attn_type != AttentionType.DECODER, "an fp8 KV cache": kv_cache_dtype != "auto",
                # its verification steps and the draft's own attention were never checked against the HF path
                "speculative decoding": getattr(vllm_config, "speculative_config", None) is not None}
        refused = [k for k, v in what.items() if v is not None and v is not False]
        if refused:
            raise ServingError(f"{hf.model_type}: the kvsqueeze backend does not serve {', '.join(refused)}; serve "
                               "this model with vLLM's own backend" + (" or without --speculative-config"
                                                                     if refused == ["speculative decoding"] else ""))
        tp = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
        model_heads = int(getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads)
        if model_heads % tp or self.num_kv_heads * tp != model_heads:
            raise ServingError(f"{hf.model_type}: --tensor-parallel-size {tp} does not share the model's "
                               f"{model_heads} KV heads equally (vLLM would copy heads to every rank); serve with a "
                               "--tensor-parallel-size that divides the KV heads")
        self.rank, self.ranks = _tensor_parallel(vllm_config, "building the attention")
        self.channels = model_heads * head_size  # every KV head's: what a token's keys and values are encoded over
        self.config = ServingConfig.from_env()
        _ = self.config.spec  # a bad method fails here, before any weight is loaded
        KeyWeights.checked = False  # a model is being built: its weights are checked as they load
        _ROTARIES_RUN.clear()  # and its RoPE against the rotary modules that turn its keys
        self.config.check_model(int(hf.num_hidden_layers), model_heads, head_size, int(hf.num_attention_heads),
                                int(hf.hidden_size), getattr(hf, "vocab_size", None))
        self.rope = _rope(hf, head_size)
        self.block_size = vllm_config.cache_config.block_size
        self.layout = None
        self.layer = None  # the decoder layer's index, from its name at the first step
        self.window = self.config.spec.window
        self.window_store = self._window_store(vllm_config, int(hf.num_hidden_layers)) if self.window else None
        self.overflow = 0  # key outliers clipped by the per-token budget, summed
        self.keys_taken = self.keys_turned_back = 0  # steps whose pre-RoPE keys came from the rotary step / not
        PreRopeKeys.enabled = True
        self._warm_up()

    def _window_store(self, vllm_config, layers: int) -> WindowStore:
        """The engine's `WindowStore` (made by the first layer's attention, found by the others)."""
        pp = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)
        if pp > 1:
            raise ServingError(f"{self.config.spec.name}: an fp16 window is served with --pipeline-parallel-size 1 "
                               "only (its pages hold every layer's keys); serve a method without ':rN' to split "
                               "layers over ranks")
        name = f"kvsqueeze_window.{layers}"  # one integer in the name: vLLM reads a layer index from it
        store = vllm_config.compilation_config.static_forward_context.get(name)
        if store is None:
            block = vllm_config.cache_config.block_size
            codes = sum(self.config.page_bytes(i, self.channels, block, self.head_size, self.rank, self.ranks)
                        for i in range(layers))  # one block of every layer's pages
            entry = layers * 2 * self.num_kv_heads * self.head_size * 2
            tokens = window_page_tokens(block, codes, entry)
            if tokens * entry > codes:
                logger.warning("kvsqueeze: one token's fp16 window entry (%d bytes, every layer's keys and values) "
                               "is larger than a %d-token block of the layers' pages (%d bytes); vLLM pads every "
                               "block to it, so %s holds %.1fx fewer tokens than its codes would. Serve with a larger "
                               "--block-size (128), or a method without ':r%d'", entry, block, codes,
                               self.config.spec.name, entry / codes, self.window)
            store = WindowStore(name, layers, self.num_kv_heads, self.head_size, self.window, tokens)
        return store

    def _layout(self, layer, kv_cache: torch.Tensor):
        if self.layout is None:
            if not KeyWeights.checked:
                raise ServingError("the kvsqueeze backend checks the key weights vLLM loads against the recipe's "
                                   "model as its default loader streams the checkpoint; this model was loaded "
                                   "otherwise (another --load-format, or dummy weights), so that the recipe may "
                                   "belong to another model; load it with --load-format auto or safetensors")
            _check_rotary(self.rope, self.head_size)
            name = getattr(layer, "layer_name", "")
            self.layer = _layer_index(name)
            # built outside the engine's inference mode: tensors made inside it keep no version counter, and the
            # decode kernel's tables of them (`kernels.numba.attend._luts`) would be built again on every call
            with torch.inference_mode(False):
                layout = self.config.layout(self.layer, self.channels, self.head_size, self.block_size, self.rank,
                                            self.ranks)
                layout._levels(kv_cache.device)  # the levels a view decodes with, kept by the layout
            if kv_cache[0].numel() != layout.page_bytes:
                raise ServingError(f"attention {name!r}: the engine gave it pages of {kv_cache[0].numel()} bytes, its "
                                   f"layout takes {layout.page_bytes} ({self.config.spec.name})")
            self.layout = layout
        return self.layout

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: KVSqueezeMetadata, output: torch.Tensor | None = None, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        if output is None:
            output = torch.empty(query.shape[0], self.num_heads * self.head_size, dtype=query.dtype,
                                 device=query.device)
        if attn_metadata is None or kv_cache.numel() == 0:  # the engine's profiling run
            return output.zero_()
        md = attn_metadata
        n = md.num_actual_tokens
        layout = self._layout(layer, kv_cache)
        pages = kv_cache.view(kv_cache.shape[0], -1)
        h, hq, d = self.num_kv_heads, self.num_heads, self.head_size
        q = query[:n].view(n, hq, d).float()
        k = key[:n].view(n, h, d).float()
        v = value[:n].view(n, h * d).float()
        pos = md.positions.to(k.device)
        k_pre = self._pre_rope(k, pos, torch.finfo(key.dtype).eps).reshape(n, h * d)
        self.overflow += layout.write(pages, md.slot_mapping, *self._every_head(k_pre, v), pos)
        window = self._write_window(k_pre, v, n, md.memo) if self.window else None
        out = output[:n].view(n, hq, d)
        qsl, lens = md.query_start_loc_cpu, md.seq_lens_cpu
        nd = md.decode.numel()
        if nd:
            view, mask = layout.view(pages, md.decode_table, md.decode_lens, in_place=True, memo=md.memo)
            if window is not None:  # each row's last W tokens read exact, as the HF store's window gives them
                view = self._with_window(layout, pages, view, *window, md)
            rows = md.decode if md.lead else qsl[md.decode]  # decode requests first: their tokens are rows 0 .. D - 1
            o = decode_attention(_decode_rows(q, rows, md.lead).contiguous(), view, self.rope, self.scale,
                                 key_mask=mask, backend=self.config.decode, softcap=self.softcap)
            if md.lead:
                out[:nd] = o
            else:
                out[rows] = o.to(out.dtype)
        for r in md.prefill:
            a, b = int(qsl[r]), int(qsl[r + 1])
            qr = query[a:b].view(b - a, hq, d)
            win = None if window is None else (window[0], window[1][r])
            out[a:b] = self._prefill(layout, pages, md.block_table[r:r + 1], int(lens[r]), qr, win).to(out.dtype)
        return output

    def _every_head(self, k_pre: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's pre-RoPE keys and values [N, C] of every KV head: this rank's [N, H * D] gathered from every
        tensor-parallel rank (rank r holds heads r * H .. (r + 1) * H - 1), or as they are with one rank."""
        if self.ranks == 1:
            return k_pre, v
        from vllm.distributed import tensor_model_parallel_all_gather

        both = tensor_model_parallel_all_gather(torch.stack([k_pre, v]).contiguous(), dim=-1)  # [2, N, C]
        return both[0], both[1]

    def _write_window(self, k_pre: torch.Tensor, v: torch.Tensor, n: int,
                      memo: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this layer's fp16 keys (pre-RoPE) and values of every token of the step into the window's pages
        (`WindowStore`); the window pages [blocks, Bw, layers, 2, C] and their block table [R, blocks]. The
        slots are found once per step (`memo`: the step's, shared by its layers). On CPU one compiled call writes
        them (`kernels.numba.pages.put_halves`) instead of torch's stack, cast and indexed write of 16-bit pages."""
        hit = memo.get("window_write")
        store = self.window_store.tokens()
        if hit is None:
            md = get_forward_context().attn_metadata
            wmd = md.get(self.window_store.layer_name) if isinstance(md, dict) else None
            if wmd is None:
                raise ServingError(f"the step's attention metadata holds none for {self.window_store.layer_name!r}, "
                                   "the fp16 window's pages: this vLLM does not build the window's KV group (serve "
                                   "with the vLLM version kvsqueeze pins, without micro-batching)")
            bw = store.shape[1]
            slot = wmd.slot_mapping[:n].to(torch.int64)
            if store.device.type == "cpu":  # each token's first word in the buffer, -1 for padding (no slot)
                starts = torch.where(slot >= 0, slot // bw * store.stride(0) + slot % bw * store.stride(1), -1)
                hit = (None, None, None, wmd.block_table, (_words(store).view(np.uint16), starts.numpy()))
            else:
                keep = slot >= 0  # padding tokens have none
                slot = slot[keep]
                hit = (keep, slot // bw, slot % bw, wmd.block_table, None)
            memo["window_write"] = hit
        keep, page, off, table, host = hit
        if host is not None:
            from ..kernels.numba.pages import put_halves

            words, starts = host
            put_halves(words, starts, self.layer * store.stride(2), _host(k_pre), _host(v), store.stride(3))
            return store, table
        if keep is not None:
            k_pre, v = k_pre[keep], v[keep]
        store[page, off, self.layer] = torch.stack([k_pre, v], dim=1).to(torch.float16)  # [n, 2, C]
        return store, table

    def _with_window(self, layout, pages: torch.Tensor, view, store: torch.Tensor, table: torch.Tensor,
                     md: KVSqueezeMetadata):
        """`view` whose decode rows also read their last W tokens exact (`PageLayout.with_window`): the keys
        (pre-RoPE) and values of positions lens - W .. lens - 1 from the window's pages (`store` and its block
        table; zeros before position 0, which `with_window` gives no entry); where they lie is found once per step
        (`md.memo`). On CPU one compiled pass copies each row's sinks and window entries side by side
        (`kernels.numba.pages.sinks_and_window`), where torch's indexing of 16-bit pages and two joins took
        several calls a layer."""
        hit = md.memo.get("window_read")
        if hit is None:
            w = self.window
            pos = md.decode_lens.to(torch.int64).view(-1, 1) - w + torch.arange(w).view(1, -1)
            rows = _decode_rows(table, md.decode, md.lead)
            page, off = WindowStore.slots(rows.to(pos.device), pos.clamp(min=0), store.shape[1])
            before = (pos < 0).view(*pos.shape, 1, 1)
            host = None
            if store.device.type == "cpu":  # the buffer's 16-bit words, each entry's first at layer 0 (-1: none)
                starts = torch.where(pos < 0, -1, page * store.stride(0) + off * store.stride(1))
                first = md.decode_table[:, 0].to(torch.int64)
                host = (_words(store), starts.numpy(), first.numpy())
            hit = md.memo["window_read"] = (page, off, before, host)
        page, off, before, host = hit
        if host is None:
            kv = store[page, off, self.layer].masked_fill(before, 0)  # [D, W, 2, C]
            return layout.with_window(view, kv[:, :, 0], kv[:, :, 1], md.decode_lens, memo=md.memo)
        from ..kernels.numba.pages import sinks_and_window

        words, starts, first = host
        c = store.shape[-1]
        out = np.empty((2, starts.shape[0], layout.sinks + starts.shape[1], c), np.int16)
        sinks_and_window(*layout.sink_regions(pages), first, words, starts, self.layer * store.stride(2),
                         store.stride(3), out[0], out[1])
        both = torch.from_numpy(out).view(torch.float16)
        return layout.with_window(view, both[0], both[1], md.decode_lens, memo=md.memo, joined=True)

    _warm = False

    def _warm_up(self) -> None:
        """Once per process, as the model is built: write, read and attend a few tokens of scratch pages as
        `forward` does, so the compiled kernels are loaded, or compiled, before the first request, not in it.

        Every layer whose pages differ in which regions are empty is written and read: numba types an empty region
        as contiguous and a filled one as strided, so each such pattern is a variant of its own (a layer without
        key outlier slots, say), which the first request would otherwise compile (about a minute on 2 cores, in a
        fresh environment)."""
        if KVSqueezeImpl._warm or torch.get_default_device().type != "cpu":
            return  # a GPU engine builds the model under its device: its kernels are Triton's, not numba's
        KVSqueezeImpl._warm = True
        hq, d = self.num_heads, self.head_size
        g = torch.Generator().manual_seed(0)
        f32 = torch.float32  # explicitly: the engine builds the model under its own default dtype
        table = torch.arange(2, dtype=torch.int32).view(1, 2)
        layers = int(get_current_vllm_config().model_config.hf_text_config.num_hidden_layers)
        seen = set()
        for index in range(layers):
            layout = self.config.layout(index, self.channels, self.head_size, self.block_size, self.rank, self.ranks)
            empty = tuple(r.nbytes == 0 for r in layout.regions.values())
            if empty in seen:
                continue
            pages = layout.allocate(2)
            n = min(3, layout.block_size * 2)
            k = torch.randn(n, self.channels, generator=g, dtype=f32)  # every head's, as `_every_head` gives them
            v = torch.randn(n, self.channels, generator=g, dtype=f32)
            layout.write(pages, torch.arange(n), k, v, torch.arange(n))
            layout.read(pages, table[0], n)
            view, mask = layout.view(pages, table, torch.tensor([n]), in_place=True)
            if not seen:
                decode_attention(torch.randn(1, hq, d, generator=g, dtype=f32), view, self.rope, self.scale,
                                 key_mask=mask, backend=self.config.decode, softcap=self.softcap)
            seen.add(empty)
        if self.window:  # the window's reader and writer (`_with_window`, `_write_window`)
            from ..kernels.numba.pages import put_halves, sinks_and_window

            layout = self.config.layout(0, self.channels, self.head_size, self.block_size, self.rank, self.ranks)
            sinks = layout.sink_regions(layout.allocate(2))
            out = np.empty((2, 1, layout.sinks + 2, layout.channels), np.int16)
            sinks_and_window(*sinks, np.zeros(1, np.int64), np.zeros(8 * out.shape[-1], np.int16),
                             np.array([[0, -1]]), 0, out.shape[-1], out[0], out[1])
            put_halves(np.zeros(8, np.uint16), np.array([0, -1]), 0, np.zeros((2, 2), np.float32),
                       np.zeros((2, 2), np.float32), 2)

    def _pre_rope(self, k: torch.Tensor, pos: torch.Tensor, eps: float) -> torch.Tensor:
        """This step's keys [N, H, D] before RoPE: as the rotary step was given them where they are this layer's,
        else the post-RoPE keys turned back. The kept keys are this layer's if, turned back, the post-RoPE keys
        give them to float rounding at the first, middle and last token (keys of another layer or tensor differ
        by far more than rounding everywhere)."""
        kept = PreRopeKeys.take()
        n = k.shape[0]
        if kept is not None and kept.shape[0] >= n and kept[:n].numel() == k.numel():
            kept = kept[:n].reshape(k.shape).to(k.device, torch.float32)
            rows = torch.tensor(sorted({0, n // 2, n - 1}), device=k.device)
            back = self._unturn(k[rows], pos[rows])
            tol = 16 * eps * (1.0 + float(back.abs().amax()))  # rounding of the model's dtype, far below a code step
            if bool(((kept[rows] - back).abs() <= tol).all()):
                self.keys_taken += 1
                return kept
        self.keys_turned_back += 1
        if self.keys_turned_back == 1:  # exact to float rounding: the RoPE was checked against vLLM's (`_check_rotary`)
            logger.info("kvsqueeze: layer %s turns the post-RoPE keys back by their positions (the rotary step's own "
                        "keys were not at hand: torch.compile, or a rotary step of another class)",
                        getattr(self, "layer", None))
        return self._unturn(k, pos)

    def _unturn(self, k: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Post-RoPE keys [N, H, D] turned back to the keys before RoPE, by the float32 angles vLLM turned them."""
        return self.rope.unapply(k.transpose(0, 1), pos, float32_angles=True).transpose(0, 1)

    def _angles(self, t: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin [t, R/2] at positions 0 .. t - 1 in `dtype`, as `Rope.apply` computes and casts them;
        kept by this layer (grown by doubling), not evaluated again for every prefill chunk."""
        memo = self.__dict__.setdefault("_angle_memo", {})
        hit = memo.get((dtype, device))
        if hit is None or hit[0].shape[0] < t:
            cap = max(t, 2 * hit[0].shape[0] if hit is not None else 1024)
            cos, sin = self.rope.cos_sin(torch.arange(cap))
            hit = memo[(dtype, device)] = (cos.to(device, dtype), sin.to(device, dtype))
        return hit[0][:t], hit[1][:t]

    def _prefill(self, layout, pages, table, seq_len: int, q: torch.Tensor, window=None) -> torch.Tensor:
        """Causal attention of a chunk's queries [Q, Hq, D] (the last Q tokens) over the sequence's pages, in the
        model's dtype: the dequantized keys and values cast to it and the keys turned in it, as the HF path's
        prefill hands them to the model's attention. With a window (its pages and this row's block table), each
        query reads its last W tokens' exact copies instead (`mixed_attention`, as the HF path's prefill does)."""
        k, v = layout.read(pages, table[0], seq_len)  # [T, C] pre-RoPE keys, straight from the pages
        t, h, d = seq_len, self.num_kv_heads, self.head_size
        cos, sin = self._angles(t, q.dtype, q.device)  # what `Rope.apply` computes at positions 0 .. t - 1
        k = apply_rope(k.view(t, h, d).transpose(0, 1).to(q.dtype), cos, sin, self.rope.rotary_dim)
        v = v.view(t, h, d).transpose(0, 1).to(q.dtype)  # [H, T, D]
        nq = q.shape[0]
        if window is not None:
            store, row = window
            start = max(0, t - nq - self.window + 1)  # older tokens are out of every query's window
            pos = torch.arange(start, t).view(1, -1)
            page, off = WindowStore.slots(row.view(1, -1).to(pos.device), pos, store.shape[1])
            ek, ev = (store[page[0], off[0], self.layer, i].float() for i in (0, 1))  # [T', C]
            tw = t - start
            ek = apply_rope(ek.view(tw, h, d).transpose(0, 1).to(q.dtype), cos[start:], sin[start:],
                            self.rope.rotary_dim)
            ev = ev.view(tw, h, d).transpose(0, 1).to(q.dtype)
            o, _ = mixed_attention(q.transpose(0, 1).unsqueeze(0), ek.unsqueeze(0), ev.unsqueeze(0), k.unsqueeze(0),
                                   v.unsqueeze(0), None, self.scale, self.window, softcap=self.softcap, start=start)
            return o[0]  # [Q, Hq, D]
        qpos = torch.arange(t - nq, t, device=q.device)
        allowed = torch.arange(t, device=q.device).view(1, -1) <= qpos.view(-1, 1)  # [Q, T]
        if self.softcap is None:  # torch's fused attention, as the HF path's prefill (sdpa) computes it
            whole = nq == t  # a whole prompt: plain causal, which lets torch skip the masked blocks
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1).contiguous().unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                attn_mask=None if whole else allowed, is_causal=whole, scale=self.scale, enable_gqa=True)
            return o[0].transpose(0, 1)
        g = self.num_heads // h
        q, k, v = q.float(), k.float().repeat_interleave(g, dim=0), v.float().repeat_interleave(g, dim=0)
        scores = torch.einsum("qhd,htd->hqt", q, k) * self.scale
        scores = self.softcap * torch.tanh(scores / self.softcap)
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        return torch.einsum("hqt,htd->qhd", probs, v)
