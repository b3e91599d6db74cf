"""Decoder families beyond LLaMA / Mistral / Qwen2: each is supported end to end, or refused by the preflight.

Supported here: Qwen3 and OLMo-2, whose keys pass a `k_norm` between `k_proj`
and RoPE (per head in Qwen3, over the whole projection in OLMo-2): kvsqueeze
reads them after the norm, where the model hands them to its rotary step, in
calibration, simulation, the compressed cache and the kernels alike; and LLaMA
with llama3 rope scaling (rescaled frequencies, read from the rotary module). Refused,
within one short forward and with the layer and the family named: OLMo's
in-place `clip_qkv`, SmolLM3's layers without RoPE, Phi-3's fused `qkv_proj`,
Gemma-3's per-layer-type RoPE, Cohere's interleaved RoPE pairs and Phi's
partial rotary.
"""

from __future__ import annotations

import time

import pytest
import torch

import kvsqueeze
from conftest import HEAD_DIM, HIDDEN, INIT_STD, KV_HEADS, LAYERS, VOCAB, random_ids
from kvsqueeze.calibrate.collect import collect
from kvsqueeze.calibrate.fit import CalibrationConfig, fit_recipe
from kvsqueeze.integrations.fused import fused_decode
from kvsqueeze.integrations.preflight import UnsupportedModelError, preflight
from kvsqueeze.integrations.simulate import SimulatedQuantization
from kvsqueeze.methods import parse_method

SMALL_CAL = CalibrationConfig(samples=2, seqlen=64, bits=(3,), fractions=(0.0, 0.01), fits=("fs2",))


def family_model(arch: str, seed: int = 0, attn: str = "sdpa", **overrides):
    """A tiny random decoder of `arch` (2 layers, 4 query heads over 2 KV heads of 16), float32."""
    import transformers
    from transformers import AutoModelForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=HIDDEN // HEAD_DIM, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                  max_position_embeddings=1024, initializer_range=INIT_STD, tie_word_embeddings=False,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cls = {"llama": "LlamaConfig", "qwen3": "Qwen3Config", "olmo2": "Olmo2Config", "olmo": "OlmoConfig", "smollm3": "SmolLM3Config",
           "phi3": "Phi3Config", "gemma3": "Gemma3TextConfig", "cohere": "CohereConfig", "phi": "PhiConfig",
           "gemma2": "Gemma2Config"}[arch]
    cfg = getattr(transformers, cls)(**{**common, **overrides})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32).eval()


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # rescaled low frequencies


@pytest.fixture(scope="module", params=["qwen3", "olmo2", "llama3"])
def supported(request):
    """(arch, model, recipe), the recipe calibrated in-test on random tokens."""
    if request.param == "llama3":
        model = family_model("llama", seed=3, rope_parameters=LLAMA3_ROPE)
    else:
        model = family_model(request.param, seed=3)
    acts = collect(model, random_ids(SMALL_CAL.samples, SMALL_CAL.seqlen, seed=5), sinks=1, progress=False)
    return request.param, model, fit_recipe(model, acts, SMALL_CAL, f"tiny-{request.param}", "random",
                                            progress=False)


def test_keys_are_read_where_the_model_rotates_them(supported):
    arch, model, _ = supported
    from kvsqueeze.integrations.parts import attention_modules, key_source

    assert {key_source(a) for a in attention_modules(model)} == {"k_proj" if arch == "llama3" else "k_norm"}
    preflight(model)  # passes


def test_fp16_cache_gives_the_models_own_logits(supported):
    """The fp16 method is the model's own attention over its keys and values rounded to fp16 as they are cached."""
    from transformers.cache_utils import Cache, DynamicLayer

    class RoundedLayer(DynamicLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            return super().update(key_states.half().float(), value_states.half().float(), *args, **kwargs)

    _, model, recipe = supported
    ids = random_ids(1, 24, seed=1)
    with torch.no_grad():
        want = model(ids, cache=Cache(layers=[RoundedLayer() for _ in range(LAYERS)]), use_cache=True).logits
        got = model(ids, cache=kvsqueeze.cache_for(model, recipe, "fp16"), use_cache=True).logits
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_compressed_cache_equals_simulated_quantization(supported):
    _, model, recipe = supported
    ids = random_ids(1, 32, seed=2)
    with torch.no_grad():
        with SimulatedQuantization(model, parse_method("nuq3-1%"), recipe) as sim:
            want = model(ids, cache=sim.new_cache(), use_cache=True).logits
        cache = kvsqueeze.cache_for(model, recipe, "nuq3-1%")
        got = torch.cat([model(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(32)], dim=1)
        fp = model(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(want, fp, atol=1e-3)  # the quantization did something


def test_fused_decode_equals_dense_with_a_left_padded_batch(supported):
    _, model, recipe = supported
    ids = random_ids(2, 10, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    kw = dict(attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        dense = model.generate(ids, cache=kvsqueeze.cache_for(model, recipe, "nuq3-1%"), **kw)
        cache = kvsqueeze.cache_for(model, recipe, "nuq3-1%")
        with fused_decode(model, cache):
            fused = model.generate(ids, cache=cache, **kw)
    assert fused.shape == (2, 22) and torch.equal(fused, dense)


REFUSED = {  # arch, config overrides, what the refusal must say
    "olmo": (dict(clip_qkv=2.0, head_dim=None), "clip_qkv"),
    "smollm3": (dict(no_rope_layers=[1, 0]), "without RoPE"),
    "phi3": (dict(head_dim=None), "fused q/k/v"),
    "gemma3": (dict(), "layer type"),
    "cohere": (dict(head_dim=None), "not its `k_proj` output turned by rotate-half RoPE"),
    "phi": (dict(partial_rotary_factor=0.5, head_dim=None), "partial rotary"),
}


@pytest.mark.parametrize("arch", sorted(REFUSED))
def test_unsupported_families_are_refused_before_any_work(arch, tiny_recipe):
    overrides, needle = REFUSED[arch]
    model = family_model(arch, **{k: v for k, v in overrides.items() if v is not None})
    t0 = time.perf_counter()
    with pytest.raises(UnsupportedModelError, match="layer|fused") as err:
        preflight(model)
    assert time.perf_counter() - t0 < 10
    message = str(err.value)
    assert needle in message and type(model).__name__ in message, message
    for work in (lambda: collect(model, random_ids(1, 16), progress=False),
                 lambda: SimulatedQuantization(model, parse_method("int3:pre"), None)):
        with pytest.raises(UnsupportedModelError, match=needle.split()[0]):
            work()


def test_post_rope_methods_need_only_the_values(tiny_recipe):
    """Keys quantized after RoPE are the keys the model caches: a family whose pre-RoPE keys cannot be read
    (interleaved RoPE) is still measured with them, its values checked."""
    model = family_model("cohere")
    ids = random_ids(1, 16, seed=3)
    with torch.no_grad(), SimulatedQuantization(model, parse_method("int4"), None) as sim:
        got = model(ids, cache=sim.new_cache(), use_cache=True).logits
    assert torch.isfinite(got).all()
    with pytest.raises(UnsupportedModelError, match="rotate-half"):
        SimulatedQuantization(model, parse_method("int4:pre"), None)


def test_a_norm_the_forward_never_calls_is_refused():
    """A k_norm module that exists but is not applied (as a config flag can turn it off): keys are not read there."""
    import types

    model = family_model("qwen3", seed=4)
    attn = model.model.layers[0].self_attn
    forward = type(attn).forward

    def forward_without_its_k_norm(self, *args, **kwargs):
        norm, self.k_norm = self.k_norm, torch.nn.Identity()  # the hooked module sits idle
        try:
            return forward(self, *args, **kwargs)
        finally:
            self.k_norm = norm

    attn.forward = types.MethodType(forward_without_its_k_norm, attn)
    with pytest.raises(UnsupportedModelError, match="layer 0 .*`k_norm` is not called"):
        preflight(model)


def test_soft_capped_logits_are_refused_where_they_would_be_dropped():
    """Gemma-2 soft-caps its attention logits: the fused kernel and the simulated KIVI attention do not, so
    they refuse the model when they are switched on, before any token; the dense cache path keeps the model's
    own (eager) attention, which does."""
    from kvsqueeze.integrations.fused import enable_fused_decode

    model = family_model("gemma2", seed=6, attn="eager", attn_logit_softcapping=20.0)
    acts = collect(model, random_ids(SMALL_CAL.samples, SMALL_CAL.seqlen, seed=5), sinks=1, progress=False)
    recipe = fit_recipe(model, acts, SMALL_CAL, "tiny-gemma2", "random", progress=False)
    cache = kvsqueeze.cache_for(model, recipe, "nuq3-1%")
    with pytest.raises(UnsupportedModelError, match="softcap"):
        enable_fused_decode(model, cache)
    assert model.config._attn_implementation == "eager"
    with pytest.raises(UnsupportedModelError, match="softcap"):
        SimulatedQuantization(model, parse_method("kivi2"), None)
    with torch.no_grad():  # the dense path: the model's own attention over the dequantized cache
        out = model.generate(random_ids(1, 6, seed=2), cache=cache, max_new_tokens=4, min_new_tokens=4,
                             do_sample=False, pad_token_id=0)
    assert out.shape == (1, 10)
