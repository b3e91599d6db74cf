"""vLLM's engine with kvsqueeze's attention backend against kvsqueeze's own HF path.

vLLM lives in an environment of its own (`make vllm-setup`: it pins another transformers); these tests run its
engine there, in a subprocess, and compare what it generates with the HF path here. They are skipped when that
environment is missing; `make vllm-test` builds it and runs them.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from tests.serving.vllm_env import ROOT, VLLM_PYTHON

METHOD = "nuq3-1%:kslots2"

pytestmark = [pytest.mark.skipif(not VLLM_PYTHON.exists(),
                                 reason=f"no vLLM environment at {VLLM_PYTHON} (make vllm-setup)"),
              pytest.mark.usefixtures("own_attention")]  # a windowed cache selects kvsqueeze's attention


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(0, 256, (40,), generator=g).tolist()  # two prompts share 40 tokens: prefix hits
    return [shared + torch.randint(0, 256, (30,), generator=g).tolist(),
            torch.randint(0, 256, (9,), generator=g).tolist(),
            shared + torch.randint(0, 256, (5,), generator=g).tolist(),
            torch.randint(0, 256, (23,), generator=g).tolist()]


def _vllm(tmp_path, model_dir, recipe_dir, prompts, *extra, method: str = METHOD) -> dict:
    tmp_path.mkdir(parents=True, exist_ok=True)
    pf = tmp_path / "prompts.json"
    pf.write_text(json.dumps(prompts))
    out = tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSQUEEZE_", "TRITON_"))}
    ranks = int(extra[extra.index("--tensor-parallel-size") + 1]) if "--tensor-parallel-size" in extra else 1
    env.update(OMP_NUM_THREADS=str(2 // ranks), VLLM_CPU_OMP_THREADS_BIND="nobind")  # a core per rank
    cmd = [str(VLLM_PYTHON), "-m", "kvsqueeze.serving.vllm_run", "--model", str(model_dir), "--recipe",
           str(recipe_dir), "--method", method, "--prompts", str(pf), "--max-tokens", "12", "--block-size", "16",
           "--max-model-len", "256", "--kv-bytes", str(64 << 20), "--skip-tokenizer-init", "--out", str(out), *extra]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return json.loads(out.read_text())


def _hf_tokens(model, recipe_dir, prompts, new: int, method: str = METHOD) -> list[list[int]]:
    import kvsqueeze

    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with kvsqueeze.cache_for(model, recipe_dir, method) as cache, kvsqueeze.fused_decode(model, cache):
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False, cache=cache, pad_token_id=0)  # token 0 is in the prompts too
        out.append(g[0, len(p):].tolist())
    return out


def test_vllm_engine_generates_what_the_hf_path_generates(tiny_llama, tiny_model_dir, tiny_recipe_dir, tmp_path):
    """Greedy tokens of vLLM's engine with the kvsqueeze backend (paged compressed cache, chunked prefill of 16
    tokens a step, continuous batching of four prompts, a prompt whose prefix is cached, a second round from the
    prefix cache) equal the HF path's compressed cache with the fused kernel."""
    prompts = _prompts()
    got = _vllm(tmp_path, tiny_model_dir, tiny_recipe_dir, prompts, "--max-num-batched-tokens", "16", "--repeat", "2")
    assert got["method"] == METHOD and got["block_size"] == 16
    want = _hf_tokens(tiny_llama, tiny_recipe_dir, prompts, 12)
    first, again = (r["tokens"] for r in got["runs"])
    compared = sum(len(w) for w in want)
    equal = sum(a == b for w, g in zip(want, first) for a, b in zip(w, g))
    assert compared == 48 and equal >= 0.95 * compared, (want, first)
    assert again == first  # the second round prefills from cached pages and reads the same cache
    # the pages really are compressed: far more token slots than vLLM's own float32 cache would hold
    channels, layers = 2 * 16, 2
    fp_tokens = (64 << 20) // (2 * channels * 4 * layers)
    assert got["kv_tokens"] > 4 * fp_tokens


def test_vllm_serves_a_bit_budget_with_pages_of_each_layer_s_own_size(tiny_llama, tiny_model_dir, tiny_recipe,
                                                                     tmp_path):
    """A per-channel bit budget whose two layers have different widths and outliers: vLLM gives each layer pages
    of its own size (the KV space holds as many blocks as the sum of the layers' pages allows, not the largest
    page twice), and generates what the HF path's compressed cache generates for the same method."""
    from kvsqueeze.serving.settings import ServingConfig
    from test_budget import _mixed

    recipe_dir = _mixed(tiny_recipe, 3.0).save(tmp_path / "budget")
    config = ServingConfig(str(recipe_dir), "nuq@3:chan")
    sizes = [config.page_bytes(layer, 32, 16, 16) for layer in range(2)]
    assert sizes[0] != sizes[1]
    prompts = _prompts()
    got = _vllm(tmp_path, tiny_model_dir, recipe_dir, prompts, method="nuq@3:chan")
    assert got["method"] == config.spec.name
    # the layers' pages differ in which regions are empty: each such layer's kernel variants are loaded as the
    # model is built, none is first compiled inside a request
    assert got["kernel_variants_in_requests"] == {}
    assert got["num_blocks"] == (64 << 20) // sum(sizes)
    want = _hf_tokens(tiny_llama, recipe_dir, prompts, 12, method=config.spec.name)
    first = got["runs"][0]["tokens"]
    equal = sum(a == b for w, g in zip(want, first) for a, b in zip(w, g))
    assert equal >= 0.95 * 48, (want, first)


def test_vllm_scores_tokens_as_the_hf_path_does(tiny_llama, tiny_model_dir, tiny_recipe_dir, tmp_path):
    """Teacher-forced log-probabilities through vLLM's engine with the kvsqueeze backend (`--score`: prompt
    logprobs, as benchmarks/vllm_quality.py reads them) are the HF path's through its compressed cache (whose
    prefill attends the quantized cache, as the pages' prefill does), to float rounding, and not the unquantized
    model's. (vLLM's own CPU backend has no kernel for this tiny model's 16-wide heads; on the default model its
    scores equal the HF model's: `vllm_own_over_hf_fp16_ppl` in vllm.json.)"""
    import kvsqueeze

    import numpy as np

    prompts = [p for p in _prompts() if len(p) > 20]
    ours = _vllm(tmp_path, tiny_model_dir, tiny_recipe_dir, prompts, "--score", "--logits", str(tmp_path / "lp"))
    assert len(ours["scores"]) == len(prompts) > 0
    for i, (p, q) in enumerate(zip(prompts, ours["scores"])):
        ids = torch.tensor([p])
        with torch.no_grad():
            fp = tiny_llama(ids).logits[0].float().log_softmax(-1)
            with kvsqueeze.cache_for(tiny_llama, tiny_recipe_dir, METHOD) as cache:
                qz = tiny_llama(ids, cache=cache, use_cache=True).logits[0].float().log_softmax(-1)
        target = ids[0, 1:].view(-1, 1)
        want_q, want_fp = qz[:-1].gather(1, target).view(-1), fp[:-1].gather(1, target).view(-1)
        torch.testing.assert_close(torch.tensor(q["logprob"]), want_q, rtol=0, atol=1e-3)
        # `--logits`: the whole distribution at every scored position (what KL through vLLM is computed from)
        whole = torch.from_numpy(np.load(tmp_path / "lp" / f"prompt_{i}.npy"))
        torch.testing.assert_close(whole, qz[:-1], rtol=0, atol=1e-3)
        assert float((want_q - want_fp).abs().max()) > 1e-2  # the quantized cache is another cache
        same = sum(a == b for a, b in zip(q["top1"], qz[:-1].argmax(-1).tolist()))
        assert same >= 0.95 * len(q["top1"])  # first choices: equal but where two logits tie to rounding


WINDOWED = "nuq3-1%:kslots2:r8"


@pytest.mark.parametrize("chunk", [16, 256])
def test_vllm_scores_a_method_with_an_fp16_window_as_the_hf_path_does(tiny_llama, tiny_model_dir, tiny_recipe_dir,
                                                                      tmp_path, chunk):
    """A method with an fp16 window of recent tokens (`:r8`: each query reads its last 8 tokens exact, older ones
    from the codes), prefilled whole or in chunks of 16 tokens (queries whose window reaches into the chunk before,
    read from the window's own pages), in two rounds (vLLM reads no prefix cache for a request with prompt
    log-probabilities: the greedy test below holds the prefix-cache path): vLLM's prompt log-probabilities are the
    HF compressed cache's to float rounding, and not those of the same method without the window."""
    import kvsqueeze

    import numpy as np

    prompts = [p for p in _prompts() if len(p) > 20]
    ours = _vllm(tmp_path, tiny_model_dir, tiny_recipe_dir, prompts, "--score", "--max-num-batched-tokens",
                 str(chunk), "--repeat", "2", "--logits", str(tmp_path / "lp"), method=WINDOWED)
    assert ":r8" in ours["method"]
    assert len(ours["score_rounds"]) == 2 and len(ours["scores"]) == len(ours["score_rounds"][1]) == len(prompts) > 0
    for i, (p, q, again) in enumerate(zip(prompts, ours["scores"], ours["score_rounds"][1])):
        ids = torch.tensor([p])
        target = ids[0, 1:].view(-1, 1)
        want, full = {}, {}
        with torch.no_grad():
            for method in (WINDOWED, METHOD):
                with kvsqueeze.cache_for(tiny_llama, tiny_recipe_dir, method) as cache:
                    logits = tiny_llama(ids, cache=cache, use_cache=True).logits[0].float().log_softmax(-1)
                full[method] = logits[:-1]
                want[method] = logits[:-1].gather(1, target).view(-1)
        torch.testing.assert_close(torch.tensor(q["logprob"]), want[WINDOWED], rtol=0, atol=1e-3)
        torch.testing.assert_close(torch.tensor(again["logprob"]), want[WINDOWED], rtol=0, atol=1e-3)
        # the whole distributions of the first round (prompts scored one at a time, chunk by chunk)
        whole = torch.from_numpy(np.load(tmp_path / "lp" / f"prompt_{i}.npy"))
        torch.testing.assert_close(whole, full[WINDOWED], rtol=0, atol=1e-3)
        assert float((want[WINDOWED] - want[METHOD]).abs().max()) > 1e-2  # the window changes what is read


def test_vllm_serves_a_budget_with_its_window_from_one_pool_of_blocks(tiny_llama, tiny_model_dir, tiny_recipe,
                                                                     tmp_path):
    """A per-channel budget with a window (as the presets are): its layers' pages of their own sizes and the
    window's pages come from one pool of blocks, each block as large as the larger of one block of every layer's
    pages and one window page (up to 16 tokens x 2 layers x keys and values x 32 channels x fp16, as many tokens
    as fit in the former), so the KV space holds that many blocks; prompt log-probabilities are the HF
    compressed cache's."""
    import kvsqueeze
    from kvsqueeze.serving.settings import ServingConfig, window_page_tokens
    from test_budget import _mixed

    recipe_dir = _mixed(tiny_recipe, 3.0).save(tmp_path / "budget")
    method = "nuq@3:chan:r8"
    config = ServingConfig(str(recipe_dir), method)
    pages = sum(config.page_bytes(layer, 32, 16, 16) for layer in range(2))
    window_tokens = window_page_tokens(16, pages, 2 * 2 * 32 * 2)  # as many of 16 as fit in a block of pages
    window_page = window_tokens * 2 * 2 * 32 * 2
    assert window_page <= pages  # so no block of codes is padded to a window page
    prompts = [p for p in _prompts() if len(p) > 20]
    got = _vllm(tmp_path, tiny_model_dir, recipe_dir, prompts, "--score", "--max-num-batched-tokens", "16",
                method=method)
    assert got["method"] == config.spec.name and config.spec.window == 8
    assert got["num_blocks"] == (64 << 20) // max(pages, window_page)
    assert sorted((g["block_size"], g["layers"]) for g in got["kv_cache_groups"]) == sorted([(window_tokens, 1),
                                                                                             (16, 2)])
    assert got["block_size"] == 16 and got["kv_tokens_vllm"] < got["kv_tokens"]  # window pages counted by vLLM
    assert len(got["scores"]) == len(prompts) > 0
    for p, q in zip(prompts, got["scores"]):
        ids = torch.tensor([p])
        with torch.no_grad(), kvsqueeze.cache_for(tiny_llama, recipe_dir, config.spec.name) as cache:
            logits = tiny_llama(ids, cache=cache, use_cache=True).logits[0].float().log_softmax(-1)
        want = logits[:-1].gather(1, ids[0, 1:].view(-1, 1)).view(-1)
        torch.testing.assert_close(torch.tensor(q["logprob"]), want, rtol=0, atol=1e-3)


def test_vllm_refuses_a_window_without_the_hybrid_kv_cache_manager(tiny_model_dir, tiny_recipe_dir, tmp_path):
    """Without vLLM's hybrid KV cache manager the window's sliding-window pages would become full-attention
    ones, holding every token's fp16 copy: refused before serving, naming the fix."""
    pf = tmp_path / "p.json"
    pf.write_text(json.dumps([[1, 2, 3]]))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSQUEEZE_", "TRITON_"))}
    run = subprocess.run([str(VLLM_PYTHON), "-m", "kvsqueeze.serving.vllm_run", "--model", str(tiny_model_dir),
                          "--recipe", str(tiny_recipe_dir), "--method", WINDOWED, "--prompts", str(pf),
                          "--max-model-len", "256", "--kv-bytes", str(64 << 20), "--skip-tokenizer-init",
                          "--disable-hybrid-kv-cache-manager", "--out", str(tmp_path / "o.json")],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode != 0
    assert "hybrid" in run.stdout + run.stderr and ":r8" in run.stdout + run.stderr, (run.stdout + run.stderr)[-3000:]


def test_vllm_generates_with_an_fp16_window_what_the_hf_path_generates(tiny_llama, tiny_model_dir, tiny_recipe_dir,
                                                                       tmp_path):
    """Decode with the window: each new token's query reads its last 8 tokens from the window's pages (written
    by the steps before and by this one) and older ones from the codes, batched over four prompts; greedy tokens
    equal the HF path's compressed cache with the fused kernel. A second round prefills from the prefix cache,
    the window's pages of the cached prefix included (a prompt whose prefix another one cached, too), and
    generates the same tokens."""
    prompts = _prompts()
    got = _vllm(tmp_path, tiny_model_dir, tiny_recipe_dir, prompts, "--max-num-batched-tokens", "16",
                "--repeat", "2", method=WINDOWED)
    want = _hf_tokens(tiny_llama, tiny_recipe_dir, prompts, 12, method=WINDOWED)
    first, again = (r["tokens"] for r in got["runs"])
    equal = sum(a == b for w, g in zip(want, first) for a, b in zip(w, g))
    assert equal >= 0.95 * 48, (want, first)
    assert again == first


def test_vllm_refuses_a_recipe_of_another_model(tiny_model_dir, tmp_path):
    """A recipe calibrated on a model of another shape (three layers, not two) is refused when the engine builds
    its layers, naming the fix."""
    from conftest import random_ids, tiny_model
    from kvsqueeze.calibrate.collect import collect
    from kvsqueeze.calibrate.fit import CalibrationConfig, fit_recipe

    model = tiny_model("llama", seed=5, num_hidden_layers=3)
    ids = random_ids(2, 64, seed=6)
    recipe = fit_recipe(model, collect(model, ids, sinks=1, progress=False),
                        CalibrationConfig(samples=2, seqlen=64), "tiny-llama-3", "random", progress=False)
    bad = recipe.save(tmp_path / "other")
    pf = tmp_path / "p.json"
    pf.write_text(json.dumps([[1, 2, 3]]))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSQUEEZE_", "TRITON_"))}
    run = subprocess.run([str(VLLM_PYTHON), "-m", "kvsqueeze.serving.vllm_run", "--model", str(tiny_model_dir),
                          "--recipe", str(bad), "--prompts", str(pf), "--max-model-len", "256", "--kv-bytes",
                          str(64 << 20), "--skip-tokenizer-init", "--out", str(tmp_path / "o.json")],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode != 0
    assert "belongs to another model" in run.stdout + run.stderr and "kvsqueeze calibrate" in run.stdout + run.stderr


def test_vllm_refuses_a_recipe_of_a_model_of_the_same_shape_with_other_key_weights(tiny_llama, tokenizer,
                                                                                     tiny_recipe_dir, tmp_path):
    """A fine-tune of the calibrated model (one layer's key weights moved by 1%, or only a query projection) has
    every shape of the recipe's model: the weights vLLM loads are checked against the recipe's fingerprint, and
    the engine refuses it naming the layer or tensor; the same model saved in bf16 (a change of precision, not of
    model) is served."""
    import copy

    other, queries = copy.deepcopy(tiny_llama), copy.deepcopy(tiny_llama)
    with torch.no_grad():
        other.model.layers[1].self_attn.k_proj.weight.mul_(1.01)
        queries.model.layers[0].self_attn.q_proj.weight.mul_(1.01)  # the keys' own weights left alone
    runs = {}
    served = (("tuned", other, "float32"), ("queries", queries, "float32"),
              ("bf16", copy.deepcopy(tiny_llama).to(torch.bfloat16), "float32"),
              ("served_bf16", tiny_llama, "bfloat16"))  # loaded with bf16 as torch's default dtype, as vLLM does
    for name, model, dtype in served:
        d = tmp_path / name
        model.save_pretrained(d)
        tokenizer.save_pretrained(d)
        pf = tmp_path / "p.json"
        pf.write_text(json.dumps([[1, 2, 3]]))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSQUEEZE_", "TRITON_"))}
        runs[name] = subprocess.run([str(VLLM_PYTHON), "-m", "kvsqueeze.serving.vllm_run", "--model", str(d),
                                     "--recipe", str(tiny_recipe_dir), "--prompts", str(pf), "--max-model-len",
                                     "256", "--kv-bytes", str(64 << 20), "--skip-tokenizer-init", "--dtype",
                                     dtype, "--out", str(tmp_path / f"{name}.json")],
                                    env=env, capture_output=True, text=True, timeout=900)
    tuned = runs["tuned"].stdout + runs["tuned"].stderr
    assert runs["tuned"].returncode != 0 and "key weights of layer(s) 1 differ" in tuned, tuned[-3000:]
    assert "kvsqueeze calibrate" in tuned
    queried = runs["queries"].stdout + runs["queries"].stderr
    assert runs["queries"].returncode != 0 and "model.layers.0.self_attn.q_proj.weight differ" in queried, \
        queried[-3000:]
    assert runs["bf16"].returncode == 0, (runs["bf16"].stdout + runs["bf16"].stderr)[-3000:]
    assert runs["served_bf16"].returncode == 0, (runs["served_bf16"].stdout + runs["served_bf16"].stderr)[-3000:]


WEIGHTS_SNIPPET = """
import types
import torch
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.config import VllmConfig, set_current_vllm_config
from kvsqueeze.recipe import key_digest, tensor_probe
from kvsqueeze.serving import vllm as kv

kv.register()
g = torch.Generator().manual_seed(0)
k = [torch.randn(64, 128, generator=g) for _ in range(2)]
names = [f"model.layers.{i}.self_attn.k_proj.weight" for i in range(2)]
fp = {"layers": 2, "layers_sha256": [key_digest(i, w)[0] for i, w in enumerate(k)],
      "layers_probe": [key_digest(i, w)[1] for i, w in enumerate(k)],
      "weights_probe": {n: tensor_probe(w) for n, w in zip(names, k)}}
recipe = types.SimpleNamespace(meta={"model": {"id": "tiny", "fingerprint": fp}})
probes = {n: tensor_probe(w) for n, w in zip(names, k)}


def refusal(found, probes=probes, refused=None):
    try:
        kv.KeyWeights.check(recipe, found, probes, refused)
    except kv.ServingError as e:
        return str(e)
    return None


own = {i: [(n, key_digest(i, w))] for i, (n, w) in enumerate(zip(names, k))}
assert refusal(own) is None, "the recipe's own weights are served"
tower = {i: [(f"vision_tower.encoder.layers.{i}.self_attn.k_proj.weight", key_digest(i, -w)), *own[i]]
         for i, w in enumerate(k)}
assert refusal(tower) is None, "another tower's key projections are told apart by the recipe's names"
assert "several key projections for layer 0" in refusal({0: tower[0][:1] * 2, 1: own[1]})
renamed = {f"language_model.{n}": v for n, v in probes.items()}
assert "names 0 of the 2 tensors" in refusal(own, renamed), "no tensor to compare is not a pass"
assert "quantized" in refusal(own, refused="the checkpoint is quantized (x.k_proj.qweight)")

ours = kv.Rope(1.0 / 10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
with set_current_vllm_config(VllmConfig()):
    other = RotaryEmbedding(64, 64, 4096, 500000.0, True, torch.float32)  # an earlier engine's model
    kv._ROTARIES_RUN.clear()  # this engine's model is built
    mine = RotaryEmbedding(64, 64, 4096, 10000.0, True, torch.float32)
    mine.forward_native(torch.arange(3), torch.randn(3, 64), torch.randn(3, 64))
kv._check_rotary(ours, 64)  # only the module that turned this model's keys is compared
kv._ROTARIES_RUN.clear()
try:
    kv._check_rotary(ours, 64)
    raise AssertionError("with no module run, every module built is compared")
except kv.ServingError as e:
    assert "other angles" in str(e), e
print("ok")
"""


def test_the_weight_check_tells_towers_apart_and_refuses_what_it_cannot_compare():
    """A vision tower's key projections are told apart from the model's by the recipe's names; a checkpoint that
    shares no tensor names with the recipe, or a quantized one, is refused rather than passed; the RoPE is
    checked against the rotary modules that turned this model's keys, not an earlier engine's."""
    run = subprocess.run([str(VLLM_PYTHON), "-c", WEIGHTS_SNIPPET], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout[-2000:] + run.stderr[-4000:]


def test_vllm_refuses_speculative_decoding(tiny_model_dir, tiny_recipe_dir, tmp_path):
    """Speculative decoding (prompt lookup here) verifies drafts in steps the backend was never checked on
    against the HF path: refused as the engine builds its layers, before any request."""
    pf = tmp_path / "p.json"
    pf.write_text(json.dumps([[1, 2, 3, 1, 2, 3]]))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSQUEEZE_", "TRITON_"))}
    run = subprocess.run([str(VLLM_PYTHON), "-m", "kvsqueeze.serving.vllm_run", "--model", str(tiny_model_dir),
                          "--recipe", str(tiny_recipe_dir), "--prompts", str(pf), "--max-model-len", "256",
                          "--kv-bytes", str(64 << 20), "--skip-tokenizer-init", "--speculative-ngram", "2",
                          "--out", str(tmp_path / "o.json")], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode != 0
    assert "does not serve speculative decoding" in run.stdout + run.stderr
    assert "without --speculative-config" in run.stdout + run.stderr


def test_the_cpu_platform_asks_the_backend_what_it_serves(tiny_recipe_dir):
    """On vLLM's CPU platform the plugin's backend selection runs the backend's own validation, as vLLM's GPU
    platforms do: causal decoder attention passes; non-causal or multimodal-prefix attention and batch
    invariance, which the backend does not compute, are refused instead of being run causal."""
    code = """
import torch
from kvsqueeze.serving.vllm import register
register()
from vllm.platforms.cpu import CpuPlatform
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.selector import AttentionSelectorConfig
cfg = AttentionSelectorConfig(head_size=16, dtype=torch.float32, kv_cache_dtype="auto", block_size=128,
    use_mla=False, has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
    attn_type=AttentionType.DECODER, has_sliding_window=False, use_non_causal=False, use_batch_invariant=False,
    use_kv_connector=False, use_pcp=False, use_adaptive_verification=False, use_dcp=False, use_rswa=False)
print(CpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, cfg))
for bad in ({"use_non_causal": True}, {"use_mm_prefix": True}, {"use_batch_invariant": True}):
    try:
        CpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, cfg._replace(**bad))
        print("served", bad)
    except Exception as exc:
        print("refused", type(exc).__name__, exc)
"""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TRITON_")},
           "KVSQUEEZE_RECIPE": str(tiny_recipe_dir)}
    run = subprocess.run([str(VLLM_PYTHON), "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    assert lines[0].endswith("KVSqueezeBackend") and len(lines) == 4, run.stdout
    assert all(line.startswith("refused ServingError") and "vLLM's own backend" in line for line in lines[1:])


def test_vllm_with_tensor_parallelism_gives_what_one_rank_gives(tiny_model_dir, tiny_recipe, tmp_path):
    """--tensor-parallel-size 2: each rank holds one of the tiny model's two KV heads, in pages of its share (a
    per-channel budget's shares differ in width; every rank's pages take the larger), with its own fp16 window.
    The ranks exchange the new tokens' keys and values and encode whole tokens, so what they hold is what one rank
    holds: prompt log-probabilities (chunked prefill, two rounds) and greedy tokens (prefill and decode, four
    prompts batched) equal those of one rank to float rounding."""
    from kvsqueeze.serving.settings import ServingConfig, window_page_tokens
    from test_budget import _mixed

    recipe_dir = _mixed(tiny_recipe, 3.0).save(tmp_path / "budget")
    method = "nuq@3:chan:r8"
    config = ServingConfig(str(recipe_dir), method)
    whole = [config.page_bytes(layer, 32, 16, 16) for layer in range(2)]
    shares = [[config.page_bytes(layer, 32, 16, 16, rank, 2) for layer in range(2)] for rank in range(2)]
    assert shares[0] == shares[1] and all(a < b for a, b in zip(shares[0], whole))
    window_page = window_page_tokens(16, sum(shares[0]), 2 * 2 * 16 * 2) * 2 * 2 * 16 * 2  # a rank's: its head's
    prompts = _prompts()
    runs = {}
    for tp in (1, 2):
        args = ("--max-num-batched-tokens", "16", "--tensor-parallel-size", str(tp))
        runs[tp] = (_vllm(tmp_path / f"score{tp}", tiny_model_dir, recipe_dir, [p for p in prompts if len(p) > 20],
                          "--score", "--repeat", "2", *args, method=method),
                    _vllm(tmp_path / f"gen{tp}", tiny_model_dir, recipe_dir, prompts, *args, method=method))
    assert runs[2][1]["num_blocks"] == (64 << 20) // max(sum(shares[0]), window_page)
    assert runs[2][1]["num_blocks"] > runs[1][1]["num_blocks"]  # a rank's KV space holds more of its own pages
    scored = [p for p in prompts if len(p) > 20]
    assert len(runs[1][0]["score_rounds"]) == len(runs[2][0]["score_rounds"]) == 2
    for one, two in zip(runs[1][0]["score_rounds"], runs[2][0]["score_rounds"]):
        assert len(one) == len(two) == len(scored) > 0
        for a, p, b in zip(one, scored, two):
            assert len(a["logprob"]) == len(b["logprob"]) == len(p) - 1
            torch.testing.assert_close(torch.tensor(b["logprob"]), torch.tensor(a["logprob"]), rtol=0, atol=1e-4)
    assert runs[2][1]["runs"][0]["tokens"] == runs[1][1]["runs"][0]["tokens"]


def test_vllm_refuses_a_tensor_parallel_size_that_does_not_divide_the_kv_heads(tiny_model_dir, tiny_recipe_dir,
                                                                                tmp_path):
    """Four ranks for the tiny model's two KV heads would make vLLM copy a head to two ranks: refused before
    serving, naming the fix."""
    pf = tmp_path / "p.json"
    pf.write_text(json.dumps([[1, 2, 3]]))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSQUEEZE_", "TRITON_"))}
    env.update(VLLM_CPU_OMP_THREADS_BIND="nobind")
    run = subprocess.run([str(VLLM_PYTHON), "-m", "kvsqueeze.serving.vllm_run", "--model", str(tiny_model_dir),
                          "--recipe", str(tiny_recipe_dir), "--prompts", str(pf), "--max-model-len", "256",
                          "--kv-bytes", str(64 << 20), "--skip-tokenizer-init", "--tensor-parallel-size", "4",
                          "--out", str(tmp_path / "o.json")], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode != 0
    assert "divides the KV heads" in run.stdout + run.stderr, (run.stdout + run.stderr)[-3000:]


def test_the_plugin_is_registered_for_vllm():
    """The installed entry point is what vLLM's plugin loader reads (group vllm.general_plugins)."""
    out = subprocess.run([str(VLLM_PYTHON), "-c", "from importlib.metadata import entry_points; "
                          "print([e.value for e in entry_points(group='vllm.general_plugins')])"],
                         capture_output=True, text=True, timeout=120)
    assert "kvsqueeze.serving.vllm:register" in out.stdout, out.stderr


def test_vllm_after_numba_says_what_went_wrong_and_the_fix(tiny_model_dir, tmp_path):
    """With numba imported before the engine is built (kvsqueeze's HF path imports it), vLLM's CPU worker fails
    while it replaces its Triton kernels, with its own backend too; with the plugin installed the failure names
    numba and the fix instead of an AttributeError from inside the worker."""
    pf = tmp_path / "p.json"
    pf.write_text(json.dumps([[1, 2, 3]]))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSQUEEZE_", "TRITON_"))}
    code = ("import numba, sys\nfrom kvsqueeze.serving import vllm_run\n"
            "vllm_run.main(sys.argv[1:])\n")
    run = subprocess.run([str(VLLM_PYTHON), "-c", code, "--model", str(tiny_model_dir), "--backend", "vllm",
                          "--prompts", str(pf), "--max-model-len", "256", "--kv-bytes", str(64 << 20),
                          "--skip-tokenizer-init", "--out", str(tmp_path / "o.json")], env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode != 0
    said = run.stdout + run.stderr
    assert "numba was imported in this process before the engine was built" in said, said[-3000:]
    assert "kvsqueeze.serving.vllm_run" in said


KEYS_SNIPPET = """
import torch
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.config import VllmConfig, set_current_vllm_config
from kvsqueeze.serving import vllm as kv

kv.register()
with set_current_vllm_config(VllmConfig()):
    rope = RotaryEmbedding(64, 64, 256, 10000.0, True, torch.float32)
kv.PreRopeKeys.enabled = True
pos = torch.tensor([0, 3, 17, 200, 201])
q, k = torch.randn(5, 2 * 64), torch.randn(5, 64)
k0 = k.clone()
_, turned = rope(pos, q, k)
assert not torch.allclose(turned, k0)
impl = object.__new__(kv.KVSqueezeImpl)
impl.rope = kv.Rope(1.0 / 10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
impl.keys_taken = impl.keys_turned_back = 0
eps = torch.finfo(torch.float32).eps
got = impl._pre_rope(turned.view(5, 1, 64).float(), pos, eps)
assert torch.equal(got.view(5, 64), k0) and impl.keys_taken == 1, "the rotary step's own keys are taken"
kv.PreRopeKeys.keep(torch.randn(5, 64))  # keys that are not this layer's
got = impl._pre_rope(turned.view(5, 1, 64).float(), pos, eps)
assert impl.keys_turned_back == 1 and torch.allclose(got.view(5, 64), k0, atol=1e-4), "others' keys are not"
got = impl._pre_rope(turned.view(5, 1, 64).float(), pos, eps)
assert impl.keys_turned_back == 2, "nothing kept: turned back"
kv.PreRopeKeys.keep(torch.randn(5, 128))  # a layer of another width
got = impl._pre_rope(turned.view(5, 1, 64).float(), pos, eps)
assert impl.keys_turned_back == 3 and torch.allclose(got.view(5, 64), k0, atol=1e-4), "other widths are not"
print("ok")
"""


def test_the_backend_takes_the_keys_vllm_gave_its_rotary_step():
    """Keys are quantized as vLLM's rotary step was given them when they are the layer's own, else turned back."""
    run = subprocess.run([str(VLLM_PYTHON), "-c", KEYS_SNIPPET], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout[-2000:] + run.stderr[-4000:]


ROTARY_SNIPPET = """
import torch
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.config import VllmConfig, set_current_vllm_config
from kvsqueeze.serving import vllm as kv

kv.register()
ours = kv.Rope(1.0 / 10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))


def refusal(*args):
    with set_current_vllm_config(VllmConfig()):
        rotary = RotaryEmbedding(*args)
    assert list(kv._ROTARIES) == [rotary], "each module built is noted"
    try:
        kv._check_rotary(ours, 64)
    except kv.ServingError as e:
        return str(e)
    finally:
        kv._ROTARIES.clear()
    return None


try:
    kv._check_rotary(ours, 64)
    raise AssertionError("served without any rotary module to check")
except kv.ServingError as e:
    assert "no vLLM rotary module" in str(e), e
for dtype in (torch.float32, torch.bfloat16):
    assert refusal(64, 64, 32768, 10000.0, True, dtype) is None, "the same RoPE is served"
assert "other angles" in refusal(64, 64, 32768, 500000.0, True, torch.float32), "another theta is refused"
assert "other angles" in refusal(64, 64, 32768, 10001.0, True, torch.float32), "a theta close by is refused"
assert "turns 32 of 64" in refusal(64, 32, 32768, 10000.0, True, torch.float32), "partial rotary is refused"
assert "interleaved" in refusal(64, 64, 32768, 10000.0, False, torch.float32), "GPT-J pairs are refused"
print("ok")
"""


def test_the_backend_refuses_a_rotary_step_that_turns_keys_otherwise_than_its_rope():
    """The pages hold pre-RoPE keys that the kernels turn by kvsqueeze's RoPE against queries that vLLM's rotary
    module turned: a module with another theta, width or pairing is refused, the same one in fp32 or bf16 served."""
    run = subprocess.run([str(VLLM_PYTHON), "-c", ROTARY_SNIPPET], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout[-2000:] + run.stderr[-4000:]
