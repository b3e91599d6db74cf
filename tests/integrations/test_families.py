"""The conformance matrix: decoder families of transformers, each supported end to end or refused by the preflight.

Every family below is a tiny random-weight model built from its transformers
config class (no hub). For each supported one: the preflight passes and reads
keys where the model rotates them (`k_proj`, `k_norm`, or the key slice of a
fused `qkv_proj`); the fp16 method gives the model's own logits; the compressed
cache gives the simulated path's logits for nuq3-1%; fused decode gives dense
decode's tokens on a left-padded batch of 2 through `generate()`.

Supported: LLaMA (plain, llama3 rope scaling, YaRN), Mistral (a sliding window
shorter than the sequences), Qwen2 (k_proj bias), Qwen3 and OLMo-2 (k_norm per
head / over the projection), Gemma-3 (k_norm, local and global layers with
their own RoPE bases, head_dim 256, sliding window), SmolLM3 (layers without
RoPE), Phi (partial rotary) and Phi-3 (fused qkv_proj). Refused, within one
short forward and with the layer and the family named: OLMo's in-place
`clip_qkv`, Cohere's interleaved RoPE pairs, GPT-NeoX's per-head fused
`query_key_value`, and dynamic-NTK RoPE (frequencies that change with length).
"""

from __future__ import annotations

import re
import time

import pytest
import torch

import kvsqueeze
from conftest import HEAD_DIM, HIDDEN, INIT_STD, KV_HEADS, LAYERS, VOCAB, fp16_rounded_cache, random_ids
from kvsqueeze.calibrate.collect import collect
from kvsqueeze.calibrate.fit import CalibrationConfig, fit_recipe
from kvsqueeze.integrations.fused import fused_decode
from kvsqueeze.integrations.preflight import UnsupportedModelError, preflight
from kvsqueeze.integrations.simulate import SimulatedQuantization
from kvsqueeze.kernels import Backend
from kvsqueeze.methods import parse_method

SMALL_CAL = CalibrationConfig(samples=2, seqlen=64, bits=(3,), fractions=(0.0, 0.01))
CONFIGS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
           "olmo2": "Olmo2Config", "olmo": "OlmoConfig", "smollm3": "SmolLM3Config", "phi3": "Phi3Config",
           "gemma3": "Gemma3TextConfig", "cohere": "CohereConfig", "phi": "PhiConfig", "gemma2": "Gemma2Config",
           "gpt_neox": "GPTNeoXConfig", "gpt_oss": "GptOssConfig", "llama4": "Llama4TextConfig",
           "stablelm": "StableLmConfig"}


def family_model(arch: str, seed: int = 0, attn: str = "sdpa", **overrides):
    """A tiny random decoder of `arch` (2 layers, 4 query heads over 2 KV heads of 16), float32.

    An override of None removes that entry of the common settings (families that derive head_dim)."""
    import transformers
    from transformers import AutoModelForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=HIDDEN // HEAD_DIM, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                  max_position_embeddings=1024, initializer_range=INIT_STD, tie_word_embeddings=False,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    settings = {k: v for k, v in {**common, **overrides}.items() if v is not None}
    cfg = getattr(transformers, CONFIGS[arch])(**settings)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32).eval()


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # rescaled low frequencies
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
GEMMA3 = dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=8,
              layer_types=["sliding_attention", "full_attention"])

# arch name -> (family, config overrides, where keys are read, attention implementation)
SUPPORTED = {
    "llama": ("llama", {}, "k_proj", "sdpa"),
    "llama3": ("llama", dict(rope_parameters=LLAMA3_ROPE), "k_proj", "sdpa"),
    "yarn": ("llama", dict(rope_parameters=YARN_ROPE), "k_proj", "sdpa"),
    "mistral": ("mistral", dict(sliding_window=12), "k_proj", "sdpa"),
    "qwen2": ("qwen2", {}, "k_proj", "sdpa"),
    "qwen3": ("qwen3", {}, "k_norm", "sdpa"),
    "olmo2": ("olmo2", {}, "k_norm", "sdpa"),
    "gemma3": ("gemma3", GEMMA3, "k_norm", "sdpa"),
    "gemma3-mqa": ("gemma3", dict(GEMMA3, num_key_value_heads=1), "k_norm", "sdpa"),  # as Gemma-3-270M
    "smollm3": ("smollm3", dict(no_rope_layers=[1, 0]), "k_proj", "sdpa"),
    "phi": ("phi", dict(partial_rotary_factor=0.5, head_dim=None), "k_proj", "sdpa"),
    "phi3": ("phi3", dict(head_dim=None), "qkv_proj", "sdpa"),
    "gemma2": ("gemma2", dict(attn_logit_softcapping=5.0, query_pre_attn_scalar=16, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention"]), "k_proj", "eager"),
    "gpt_oss": ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                layer_types=["sliding_attention", "full_attention"]), "k_proj", "eager"),
    # a per-head LayerNorm on [B, H, T, D] keys, RoPE over a quarter of each head, and position_ids taken by the
    # attention as a named argument (not handed on to the cache: read from the decoder's own)
    "stablelm": ("stablelm", dict(partial_rotary_factor=0.25, qk_layernorm=True, head_dim=None), "k_layernorm",
                 "sdpa"),
}


def supported_model(name: str, seed: int = 3):
    family, overrides, _, attn = SUPPORTED[name]
    model = family_model(family, seed=seed, attn=attn, **overrides)
    if family == "qwen2":  # transformers zeroes the biases: give them offsets that shift whole channels
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.k_proj.bias.copy_(torch.randn(layer.self_attn.k_proj.bias.shape, generator=g) * 2)
    return model


@pytest.fixture(scope="module", params=sorted(SUPPORTED))
def supported(request):
    """(name, model, recipe), the recipe calibrated in-test on random tokens."""
    model = supported_model(request.param)
    acts = collect(model, random_ids(SMALL_CAL.samples, SMALL_CAL.seqlen, seed=5), sinks=1, progress=False)
    return request.param, model, fit_recipe(model, acts, SMALL_CAL, f"tiny-{request.param}", "random",
                                            progress=False)


def test_keys_are_read_where_the_model_rotates_them(supported):
    name, model, _ = supported
    from kvsqueeze.integrations.parts import attention_modules, key_source

    assert {key_source(a) for a in attention_modules(model)} == {SUPPORTED[name][2]}
    preflight(model)  # passes


def test_fp16_cache_gives_the_models_own_logits(supported):
    """The fp16 method is the model's own attention over its keys and values rounded to fp16 as they are cached."""
    _, model, recipe = supported
    ids = random_ids(1, 24, seed=1)
    with torch.no_grad():
        want = model(ids, cache=fp16_rounded_cache(LAYERS), use_cache=True).logits
        got = model(ids, cache=kvsqueeze.cache_for(model, recipe, "fp16"), use_cache=True).logits
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("method", ["nuq3-1%", "nuq3-1%:r6"])
def test_compressed_cache_equals_simulated_quantization(supported, method):
    _, model, recipe = supported
    ids = random_ids(1, 32, seed=2)
    def steps(cache):  # a prefill of 12 tokens, then one token a step: both engines see the same activations
        return torch.cat([model(ids[:, :12], cache=cache, use_cache=True).logits]
                         + [model(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(12, 32)], dim=1)

    with torch.no_grad():
        with SimulatedQuantization(model, parse_method(method), recipe) as sim:
            want = steps(sim.new_cache())
        got = steps(kvsqueeze.cache_for(model, recipe, method))
        fp = model(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(want, fp, atol=1e-3)  # the quantization did something


@pytest.mark.parametrize("method", ["nuq3-1%", "nuq3-1%:r6"])
def test_fused_decode_equals_dense_with_a_left_padded_batch(supported, method):
    name, model, recipe = supported
    ids = random_ids(2, 10, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    kw = dict(attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        dense = model.generate(ids, cache=kvsqueeze.cache_for(model, recipe, method), **kw)
        cache = kvsqueeze.cache_for(model, recipe, method)
        with fused_decode(model, cache, Backend.NUMBA):
            fused = model.generate(ids, cache=cache, **kw)
    assert fused.shape == (2, 22) and torch.equal(fused, dense)


LLAMA4 = dict(intermediate_size_mlp=2 * HIDDEN, num_local_experts=1, interleave_moe_layer_step=1)
REFUSED = {  # arch, config overrides, what the refusal must say
    "olmo": ("olmo", dict(clip_qkv=2.0, head_dim=None), "clip_qkv"),
    "cohere": ("cohere", dict(head_dim=None), "not its `k_proj` output turned by rotate-half RoPE"),
    "gpt_neox": ("gpt_neox", dict(head_dim=None, num_key_value_heads=None), "query_key_value"),
    "dynamic": ("llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
                "changes its frequencies"),
    "llama4": ("llama4", dict(LLAMA4, attention_chunk_size=8), "chunked attention"),
    "llama4_full": ("llama4", dict(LLAMA4, layer_types=["full_attention"] * LAYERS), "complex frequencies"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_families_are_refused_before_any_work(name, tiny_recipe):
    arch, overrides, needle = REFUSED[name]
    model = family_model(arch, **overrides)
    t0 = time.perf_counter()
    with pytest.raises(UnsupportedModelError) as err:
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


@pytest.mark.parametrize("name", ["gemma2", "gpt_oss"])
def test_kivi_attention_honours_softcap_and_sink_logits(name):
    """KIVI's simulated attention replaces the model's: with an fp16 window over every token it must give the
    model's own logits, soft-capped (Gemma-2) or with learned sink logits (GPT-OSS), which change them."""
    model = supported_model(name)
    with torch.no_grad():
        if name == "gemma2":
            for layer in model.model.layers:
                layer.self_attn.attn_logit_softcapping = 1.0  # a cap the logits reach
        else:
            for layer in model.model.layers:
                layer.self_attn.sinks.mul_(20.0)  # sink logits that take a share of the softmax
        ids = random_ids(1, 40, seed=8)
        own = model(ids).logits
        with SimulatedQuantization(model, parse_method("kivi2:r64"), None) as sim:
            got = model(ids, cache=sim.new_cache(), use_cache=True).logits
        assert model.config._attn_implementation == "eager"  # given back
        if name == "gemma2":
            for layer in model.model.layers:
                layer.self_attn.attn_logit_softcapping = None
        else:
            for layer in model.model.layers:
                layer.self_attn.sinks.zero_().sub_(1e4)  # no share left
        without = model(ids).logits
    torch.testing.assert_close(got, own, atol=1e-5, rtol=1e-5)
    assert (own - without).abs().max() > 1e-3  # the option matters here


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_sliding_window_layers_hold_only_their_window(name, monkeypatch):
    """Sliding-window layers keep what transformers' DynamicCache keeps (the last window - 1 tokens), report the
    fp16 cache they are compared with as that, and decode the same tokens densely and fused while their oldest
    tokens are dropped (in batches of EVICT_SLACK in fused decode: 3 here, so that drops happen)."""
    from transformers import DynamicCache

    from kvsqueeze.integrations.layers import CompressedLayer
    from kvsqueeze.integrations.parts import layer_windows

    model = supported_model(name)
    acts = collect(model, random_ids(SMALL_CAL.samples, SMALL_CAL.seqlen, seed=5), sinks=1, progress=False)
    recipe = fit_recipe(model, acts, SMALL_CAL, f"tiny-{name}", "random", progress=False)
    windows = layer_windows(model)
    assert any(w is not None for w in windows)
    ids = random_ids(2, 10, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    kw = dict(attention_mask=mask, max_new_tokens=30, min_new_tokens=30, do_sample=False, pad_token_id=0)
    monkeypatch.setattr(CompressedLayer, "EVICT_SLACK", 3)
    with torch.no_grad():
        reference = DynamicCache(config=model.config)
        model.generate(ids, cache=reference, **kw)
        dense_cache = kvsqueeze.cache_for(model, recipe, "nuq3-1%")
        dense = model.generate(ids, cache=dense_cache, **kw)
        fused_cache = kvsqueeze.cache_for(model, recipe, "nuq3-1%")
        with fused_decode(model, fused_cache, Backend.NUMBA):
            fused = model.generate(ids, cache=fused_cache, **kw)
    assert torch.equal(fused, dense)
    for i, w in enumerate(windows):
        held = reference.layers[i].keys.shape[-2]
        assert dense_cache.layers[i].kept_tokens() == held == (39 if w is None else w - 1)
        assert fused_cache.layers[i].kept_tokens() <= held + 3 + 1
        assert dense_cache.layers[i].get_seq_length() == 39
    report = dense_cache.memory_report()
    assert report.dynamic_token_layers == report.held_token_layers == sum(l.keys.shape[-2] for l in reference.layers)
    assert report.fp16_bytes == sum(l.keys.nbytes + l.values.nbytes for l in reference.layers) // 2  # fp16 of fp32
    assert report.tokens == 39
    with pytest.raises(RuntimeError, match="no longer holds"):
        dense_cache.crop(-35)


def test_hybrids_cross_attention_and_interleaved_rope_are_refused_with_their_reason():
    """Layers of linear attention (Qwen3-Next), a decoder with cross-attention (BART's), and GPT-J's RoPE over
    interleaved pairs once reached the checks as tracebacks from inside them (a missing `keys`, an index past
    the cache, a shape mismatch), or an fp16 evaluation crashed part way through."""
    import transformers

    from kvsqueeze.integrations.preflight import check_methods

    base = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                num_attention_heads=HIDDEN // HEAD_DIM, num_key_value_heads=KV_HEADS, max_position_embeddings=1024,
                pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    cases = {
        "qwen3_next": (transformers.Qwen3NextConfig(**base, head_dim=HEAD_DIM, linear_num_value_heads=4,
                                                    linear_num_key_heads=2, linear_key_head_dim=16,
                                                    linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                    moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                                    layer_types=["linear_attention", "full_attention"]),
                       ["fp16", "int4", "int3:pre"], "a layer kind kvsqueeze caches do not implement"),
        "bart": (transformers.BartConfig(vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=2, decoder_layers=2,
                                         encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                         decoder_ffn_dim=128, max_position_embeddings=1024, pad_token_id=0,
                                         bos_token_id=1, eos_token_id=2, is_decoder=True, is_encoder_decoder=False),
                 ["fp16", "kivi2", "int4"], "one self-attention per layer"),
        "gptj": (transformers.GPTJConfig(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, rotary_dim=8,
                                         n_positions=1024, bos_token_id=1, eos_token_id=2),
                 ["int3:pre"], "not its `k_proj` output turned by rotate-half RoPE"),
    }
    for name, (config, methods, needle) in cases.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        for method in methods:
            with pytest.raises(UnsupportedModelError, match=re.escape(needle)):
                check_methods(model, [parse_method(method)], None)
