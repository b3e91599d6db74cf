"""What a serving engine needs to hold a layer's cache in pages: the method, the recipe, each layer's layout.

Nothing here imports transformers or the engine: a vLLM process (with whatever transformers vLLM brings) reads
the recipe, builds the quantizers and lays out pages with kvsqueeze's own numerics alone. The settings come from
the environment, so that every process of an engine (front end, engine core, workers) sees the same ones:

    KVSQUEEZE_RECIPE   the recipe directory (`kvsqueeze calibrate --out DIR`), required
    KVSQUEEZE_METHOD   the method (default the library's, the 3.5-bit preset q3.5); a bit budget without
                       ':kslotsN' gets the slots its layers' key outliers paid for (q3.5 on SmolLM2-135M is
                       served as nuq@3.5:r32:chan:kslots2), another method with outliers slots in proportion to
                       its mean count (nuq3-1% is served as nuq3-1%:kslots6 on SmolLM2-135M's 192 channels)
    KVSQUEEZE_DECODE   the decode kernel: auto (numba on CPU, Triton on GPU), numba, triton or reference
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ..config import DEFAULT_METHOD  # the library's
from ..methods import DEFAULT_CONTEXT, MethodError, MethodSpec, family, parse_method, preset_for
from ..paged.layout import PageLayout

# exact key elements per token in a page: on SmolLM2-135M's evaluation text (192 channels, 1% per-channel
# outliers, about 2.1 per token on average) six slots hold every outlier of 95% of the tokens. In
# benchmarks/results/kslots.json (5 BBC windows of 2,048 tokens) 2, 4, 6 and 8 slots all lie within the interval
# of the HF store's unbounded outliers (+5.26 ... +5.75% against +5.31%), at 3.54 to 4.03 bits; 6 slots have the
# lower KL divergence (0.051 against 0.062 with 2). A model of other widths, or another fraction, gets the same
# margin over its mean: slots = DEFAULT_KEY_SLOTS / 1.92 x (fraction x channels), rounded up (`plain_key_slots`)
DEFAULT_KEY_SLOTS = 6
_DEFAULT_SLOTS_MEAN = 0.01 * 192  # the outliers a token keeps on average where DEFAULT_KEY_SLOTS was measured


def plain_key_slots(fraction: float, channels: int) -> int:
    """Key slots a page gives a plain method keeping `fraction` of `channels` exact: DEFAULT_KEY_SLOTS for 1% of
    192 channels, in proportion to the mean for other models (32 for 1% of Llama-3-8B's 1,024)."""
    return max(1, math.ceil(DEFAULT_KEY_SLOTS * fraction * channels / _DEFAULT_SLOTS_MEAN - 1e-9))


def numba_for_engine() -> None:
    """Numba settings for an engine's process, unless set already; numba reads them when it is first imported,
    so this runs before that.

    - Its own cache (`NUMBA_CACHE_DIR` under this environment's prefix): vLLM pins another numba than kvsqueeze's
      own environment, and two numba versions sharing the cache next to the source would each throw the other's
      machine code away, so every engine start would compile the kernels again.
    - Its threading layer: TBB where the environment has it (`make vllm-setup` installs it), else `workqueue`;
      never the OpenMP layer. vLLM's numba brings a second OpenMP runtime beside torch's, and once a numba kernel
      has run, its thread keeps a core busy: torch's calls in the engine slow down several times (a bfloat16 SDPA
      of a 256-token chunk over 2,300 keys: 10 ms alone, 130 ms after a numba kernel). `workqueue` leaves torch
      alone but wakes its threads slowly, at every one of the fused kernel's passes (at 8K tokens 2.0-2.8 ms a
      call against 1.1 on OpenMP); TBB does neither (1.2 ms). Measured in docs/serving.md."""
    if "numba" in sys.modules:
        return
    os.environ.setdefault("NUMBA_CACHE_DIR", str(Path(sys.prefix) / "kvsqueeze-numba-cache"))
    layer = os.environ.get("NUMBA_THREADING_LAYER")
    if layer is None:
        os.environ["NUMBA_THREADING_LAYER"] = "tbb" if _load_tbb() else "workqueue"
    elif layer == "tbb":
        _load_tbb()


def _load_tbb() -> bool:
    """Load TBB's runtime as pip installs it (`<prefix>/lib/libtbb.so.12`, off the loader's search path, where
    numba's TBB layer would not find it); False if it is missing or older than numba accepts (2021.6)."""
    import ctypes

    path = Path(sys.prefix) / "lib" / "libtbb.so.12"
    if not path.is_file():
        return False
    try:
        lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        lib.TBB_runtime_interface_version.restype = ctypes.c_int
        return lib.TBB_runtime_interface_version() >= 12060
    except (OSError, AttributeError):
        return False


def window_page_tokens(block_size: int, block_bytes: int | None = None, token_bytes: int | None = None) -> int:
    """Tokens per page of the fp16 window (`kvsqueeze.serving.vllm.WindowStore`) beside pages of `block_size`
    tokens: few (at most 16, a power of two dividing the block size), so that a sequence holds little more than its
    window, and, given one block of the layers' pages (`block_bytes`) and a window entry (`token_bytes`: every
    layer's fp16 keys and values of one token), as many as fit in that block. vLLM makes every block of the pool
    the larger of the two: a window page larger than the layers' block would pad every block of codes to it (at
    16-token blocks of the default model, to the size of a bf16 cache's)."""
    tokens = math.gcd(16, block_size)
    if block_bytes is not None and token_bytes is not None:
        while tokens > 1 and tokens * token_bytes > block_bytes:
            tokens //= 2
    return tokens


class ServingError(ValueError):
    """A setting or model that the paged cache cannot serve; the message names the fix."""


@dataclass(frozen=True)
class ServingConfig:
    recipe: str
    method: str = DEFAULT_METHOD
    decode: str = "auto"

    @classmethod
    def from_env(cls) -> ServingConfig:
        recipe = os.environ.get("KVSQUEEZE_RECIPE")
        if not recipe:
            raise ServingError("the kvsqueeze attention backend needs a recipe: set KVSQUEEZE_RECIPE=DIR (made by "
                               "`kvsqueeze calibrate --model ... --out DIR` for this model)")
        env = os.environ
        return cls(recipe, env.get("KVSQUEEZE_METHOD", DEFAULT_METHOD), env.get("KVSQUEEZE_DECODE", "auto"))

    @functools.cached_property
    def spec(self) -> MethodSpec:
        try:
            spec = parse_method(self.method)
            if spec.budget is not None:  # a preset's fp16 window follows the tokens the recipe's model's layers hold
                from ..methods.budget import recipe_windows

                spec = preset_for(self.method, DEFAULT_CONTEXT, recipe_windows(self._recipe))
        except MethodError as exc:
            raise ServingError(f"KVSQUEEZE_METHOD={self.method!r}: {exc}") from None
        problems = []
        reason = family(spec).why_not(spec, "pages")
        if reason:
            problems.append(reason)
        if problems:
            raise ServingError(f"KVSQUEEZE_METHOD={self.method!r}: " + "; ".join(problems))
        if spec.key_slots:
            return spec
        if spec.budget is not None:  # the exact key elements per token its layers' outlier fractions paid for
            slots = self._budget_key_slots(spec)
            return dataclasses.replace(spec, key_slots=slots) if slots else spec
        if spec.outlier_fraction:
            spec = dataclasses.replace(spec, key_slots=plain_key_slots(spec.outlier_fraction, self._channels))
        return spec

    def _budget_key_slots(self, spec: MethodSpec) -> int:
        """A budget's default key slots: the most any layer's key outliers take per token on average, rounded up
        (a layer keeping 1% of 192 channels exact gets 2 slots), so a page holds what the budget paid for."""
        from ..methods.budget import layer_choices

        layers = int(self._recipe.meta["model"]["fingerprint"]["layers"])
        fractions = [layer_choices(spec, self._recipe, layer)[0].fraction for layer in range(layers)]
        return max(math.ceil(f * self._channels - 1e-9) for f in fractions)

    @property
    def _recipe(self):
        return _load_recipe(str(Path(self.recipe).resolve()))

    @property
    def _channels(self) -> int:
        """Key channels of the recipe's model (every KV head's)."""
        fp = self._recipe.meta["model"]["fingerprint"]
        return int(fp["kv_heads"]) * int(fp["head_dim"])

    def check_model(self, layers: int, kv_heads: int, head_dim: int, heads: int | None = None,
                    hidden_size: int | None = None, vocab_size: int | None = None) -> None:
        """Refuse a recipe calibrated on a model of another shape: layers, heads, widths and vocabulary (a model of
        the same shape with other weights, a fine-tune of it, is told apart later, by its key weights as vLLM
        loads them: `vllm.KeyWeights`)."""
        fp = self._recipe.meta["model"]["fingerprint"]  # a loaded recipe: its checksums and fields checked
        have = {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "heads": heads,
                "hidden_size": hidden_size, "vocab_size": vocab_size}
        have = {k: v for k, v in have.items() if v is not None}
        wrong = {k: (fp.get(k), v) for k, v in have.items() if fp.get(k) not in (None, v)}
        if wrong:
            diff = ", ".join(f"{k} {a} in the recipe, {b} in the model" for k, (a, b) in wrong.items())
            raise ServingError(f"recipe {self.recipe} belongs to another model ({diff}): calibrate one for this model "
                               "with `kvsqueeze calibrate --model ... --out DIR`")

    def layout(self, layer: int, channels: int, head_dim: int, block_size: int, rank: int = 0,
               ranks: int = 1) -> PageLayout:
        """How layer `layer` holds its tokens in pages (each layer its own widths, outliers and page size).

        `channels` are the model's (every KV head's); with `ranks` > 1 (tensor parallelism), the layout of rank
        `rank`'s share of the heads (`PageLayout`'s `heads`), its pages as large as the largest share's."""
        return _layout(self, layer, channels, head_dim, block_size, rank, ranks)

    def page_bytes(self, layer: int, channels: int, block_size: int, head_dim: int, rank: int = 0,
                   ranks: int = 1) -> int:
        """Bytes of one page of `block_size` tokens of layer `layer` (of a rank's share: see `layout`)."""
        return self.layout(layer, channels, head_dim, block_size, rank, ranks).page_bytes


@functools.lru_cache(maxsize=256)
def _layout(config: ServingConfig, layer: int, channels: int, head_dim: int, block_size: int, rank: int = 0,
            ranks: int = 1) -> PageLayout:
    """One layout per layer, shape, block size and share a process (the engine sizes pages from it, the backend
    writes them with it); built outside inference mode, so the tables the kernels keep from it carry version
    counters."""
    import torch

    from ..methods import build_quantizers

    heads = channels // head_dim
    if ranks > 1 and (heads % ranks or not 0 <= rank < ranks):
        raise ServingError(f"{heads} KV heads cannot be shared equally by {ranks} tensor-parallel ranks (rank "
                           f"{rank}): serve with a --tensor-parallel-size that divides the model's KV heads")
    with torch.inference_mode(False):
        kq, vq = build_quantizers(config.spec, config._recipe, layer, channels, head_dim)
        if ranks == 1:
            return PageLayout(kq, vq, channels, head_dim, block_size, sinks=config.spec.sinks)
        share = heads // ranks
        sizes = [PageLayout(kq, vq, channels, head_dim, block_size, sinks=config.spec.sinks,
                            heads=(r * share, share)).page_bytes for r in range(ranks)]
        return PageLayout(kq, vq, channels, head_dim, block_size, sinks=config.spec.sinks,
                          heads=(rank * share, share), min_page_bytes=max(sizes))


@functools.lru_cache(maxsize=4)
def _load_recipe(path: str):
    """One recipe read per process, whatever the number of layers (each attention layer has its own settings)."""
    from ..recipe import Recipe

    return Recipe.load(path)
