"""Tests for kvsqueeze.eval.planner: the paper's appendix-A figures, config parsing, sizes, JSON."""

from __future__ import annotations

import json

import pytest

from kvsqueeze.eval.planner import (
    BUILTIN_SHAPES,
    GIB,
    estimate_params,
    kv_cache_bytes,
    parse_bytes,
    parse_size,
    resolve_model,
    run_memory_command,
    shape_from_config,
    weight_bytes,
)
from kvsqueeze.methods import cache_bytes, parse_method
from kvsqueeze.storage import Rows

LLAMA_7B = BUILTIN_SHAPES["llama-7b"]
FP16 = parse_method("fp16")


# ---------------------------------------------------------------- the paper's table


@pytest.mark.parametrize("tokens, gib", [(32 * 1024, 16), (128 * 1024, 64), (1024**2, 512)])
def test_fp16_llama7b_matches_paper_appendix(tokens, gib):
    kv = kv_cache_bytes(LLAMA_7B, FP16, tokens)
    assert kv == 2 * 2 * 32 * 4096 * tokens  # bytes * (K, V) * layers * channels * tokens
    assert kv == gib * GIB


def test_paper_other_llamas_fp16():
    # LLaMA-13B 25 GB and LLaMA-65B 80 GB at 32K; 65B 2560 GB at 1M
    assert kv_cache_bytes(BUILTIN_SHAPES["llama-13b"], FP16, 32 * 1024) == 25 * GIB
    assert kv_cache_bytes(BUILTIN_SHAPES["llama-65b"], FP16, 32 * 1024) == 80 * GIB
    assert kv_cache_bytes(BUILTIN_SHAPES["llama-65b"], FP16, 1024**2) == 2560 * GIB


def test_nuq2_llama7b_10m_matches_paper():
    # The paper's 10M column is decimal: fp16 4883 GB = 10**7 tokens x 512 KiB.
    tokens = 10_000_000
    assert kv_cache_bytes(LLAMA_7B, FP16, tokens) / GIB == pytest.approx(4883, rel=1e-3)
    nuq2 = kv_cache_bytes(LLAMA_7B, parse_method("nuq2"), tokens) / GIB
    assert nuq2 == pytest.approx(610, rel=0.01)
    # and at 1M (binary) the paper's 64.1 GB
    assert kv_cache_bytes(LLAMA_7B, parse_method("nuq2"), 1024**2) / GIB == pytest.approx(64.1, rel=0.01)


def test_nuq3_1pct_compression_llama7b_128k():
    tokens = 128 * 1024
    ratio = kv_cache_bytes(LLAMA_7B, FP16, tokens) / kv_cache_bytes(LLAMA_7B, parse_method("nuq3-1%"), tokens)
    assert 4.4 <= ratio <= 5.0


def test_kv_bytes_are_the_registrys_count_of_the_whole_cache():
    spec = parse_method("nuq4-1%")
    whole = sum(cache_bytes(spec, 32, LLAMA_7B.channels, 128, Rows(4096)).values())
    assert kv_cache_bytes(LLAMA_7B, spec, 4096) == whole


def test_batch_shares_offline_key_scales_and_codebook():
    spec = parse_method("nuq3-1%")
    one, four = (kv_cache_bytes(LLAMA_7B, spec, 1000, b) for b in (1, 4))
    c = LLAMA_7B.channels
    # per layer: the key scale and zero-point (fp16 [C] each), the key range (float32 [C] twice), two 3-bit
    # codebooks (float32) and the pointer array's leading entry, held once for the whole batch
    shared_bytes = 32 * (2 * 2 * c + 2 * 4 * c + 2 * 8 * 4 + 4)
    assert four == 4 * one - 3 * shared_bytes
    assert kv_cache_bytes(LLAMA_7B, FP16, 1000, 4) == 4 * kv_cache_bytes(LLAMA_7B, FP16, 1000)


def test_weight_bytes():
    assert weight_bytes(LLAMA_7B, 16) == int(6.74e9 * 2)
    assert weight_bytes(LLAMA_7B, 4) == int(6.74e9 * 0.5)
    assert weight_bytes(LLAMA_7B, 16) / GIB == pytest.approx(12.6, abs=0.1)  # paper: 12.6 GB


# ---------------------------------------------------------------- model shapes


def _gqa_config(**over):
    cfg = dict(num_hidden_layers=6, num_attention_heads=12, num_key_value_heads=4, hidden_size=768,
               intermediate_size=2048, vocab_size=1000, tie_word_embeddings=True, _name_or_path="tiny-gqa")
    cfg.update(over)
    return cfg


def test_config_json_gqa(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_gqa_config()))
    for where in (tmp_path, tmp_path / "config.json"):
        shape = resolve_model(str(where))
        assert (shape.name, shape.layers, shape.kv_heads, shape.head_dim) == ("tiny-gqa", 6, 4, 64)
    assert kv_cache_bytes(shape, FP16, 1000) == 2 * 2 * 6 * 4 * 64 * 1000
    # explicit head_dim wins over hidden_size // heads
    (tmp_path / "config.json").write_text(json.dumps(_gqa_config(head_dim=128)))
    assert shape_from_config(tmp_path).head_dim == 128


def test_config_defaults_kv_heads_to_attention_heads(tmp_path):
    cfg = _gqa_config()
    del cfg["num_key_value_heads"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert shape_from_config(tmp_path).kv_heads == 12


def test_param_estimate_matches_published_counts():
    llama7b = dict(num_hidden_layers=32, num_attention_heads=32, hidden_size=4096, intermediate_size=11008,
                   vocab_size=32000, tie_word_embeddings=False)
    smollm2 = dict(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                   intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True)
    assert estimate_params(llama7b) == pytest.approx(6.74e9, rel=2e-3)
    assert estimate_params(smollm2) == pytest.approx(134.5e6, rel=2e-3)


@pytest.mark.parametrize("over, needle", [
    (dict(num_key_value_heads=0), "'num_key_value_heads' must be a positive integer"),
    (dict(num_hidden_layers=0), "'num_hidden_layers' must be a positive integer"),
    (dict(num_hidden_layers=None), "'num_hidden_layers' is missing"),
    (dict(num_key_value_heads=5), "not a multiple"),
])
def test_bad_config_rejected(tmp_path, over, needle):
    (tmp_path / "config.json").write_text(json.dumps(_gqa_config(**over)))
    with pytest.raises(ValueError, match="model config") as e:
        resolve_model(str(tmp_path))
    assert needle in str(e.value)


def test_builtin_names_case_insensitive_and_unknown_rejected(tmp_path):
    assert resolve_model("LLaMA-3-8B") is BUILTIN_SHAPES["llama-3-8b"]
    with pytest.raises(ValueError) as e:
        resolve_model("gpt-5")
    msg = str(e.value)
    assert "unknown model 'gpt-5'" in msg and "llama-7b" in msg and "config.json" in msg
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))  # an existing directory without a config


# ---------------------------------------------------------------- sizes


@pytest.mark.parametrize("text, tokens", [
    ("32K", 32768), ("128k", 131072), ("1M", 1048576), ("10M", 10485760), ("8192", 8192), ("1.5M", 1572864),
])
def test_parse_size(text, tokens):
    assert parse_size(text) == tokens


@pytest.mark.parametrize("text, needle", [
    ("0", "at least one token"), ("-1", "bad context length '-1'"), ("32Q", "bad context length '32Q'"),
    ("", "bad context length ''"), ("1.5", "not a whole number of tokens"),
])
def test_parse_size_rejects(text, needle):
    with pytest.raises(ValueError) as e:
        parse_size(text)
    assert needle in str(e.value)
    assert "32K" in str(e.value)  # names the accepted forms


def test_parse_bytes():
    assert parse_bytes("80GB") == parse_bytes("80GiB") == parse_bytes("80G") == 80 * GIB
    assert parse_bytes("48G") == 48 * GIB
    for bad in ("", "0GB", "-8GB", "80XB", "GB"):
        with pytest.raises(ValueError, match="bad memory size"):
            parse_bytes(bad)


# ---------------------------------------------------------------- the command


def test_run_memory_command_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    result = run_memory_command("llama-7b", "32K,1M", "fp16,nuq2", gpus=1, gpu_mem="80GB", json_out=str(out))
    written = json.loads(out.read_text())
    assert written == result
    assert set(written) == {"model", "rows"} and written["model"] == "llama-7b"
    assert len(written["rows"]) == 4
    for row in written["rows"]:
        assert {"method", "context", "kv_bytes", "weight_bytes", "fits"} <= set(row)
        assert isinstance(row["context"], int) and isinstance(row["kv_bytes"], int)
        assert isinstance(row["fits"], bool)
    by = {(r["method"], r["context"]): r for r in written["rows"]}
    assert by["fp16", 32768]["kv_bytes"] == 16 * GIB and by["fp16", 32768]["fits"]
    assert not by["fp16", 1048576]["fits"]
    assert by["nuq2", 1048576]["fits"]  # the paper's 1M context on one 80 GB GPU
    table = capsys.readouterr().out
    assert "1M" in table and "nuq2" in table and "fits 1x80GB" in table


def test_a_preset_is_planned_as_chosen_for_each_context(tiny_model_dir, tiny_recipe_dir, capsys):
    """`q3.5` resolves to the budget chosen for the context each row caches, as `generate`, `eval` and `ruler`
    choose it; the 2K choice held at 32K stores other bits (its window spread thinner), not what a user runs."""
    from kvsqueeze.methods.spec import preset_reaching

    result = run_memory_command(str(tiny_model_dir), "2K,32K", "q3.5", recipe=str(tiny_recipe_dir))
    rows = {r["context"]: r for r in result["rows"]}
    assert set(rows) == {2048, 32768}
    for n, r in rows.items():
        assert r["method"] == preset_reaching("q3.5", n, ()).name
    (held_2k_choice,) = run_memory_command(str(tiny_model_dir), "32K", "nuq@3.5:r32:chan",
                                           recipe=str(tiny_recipe_dir))["rows"]
    assert abs(held_2k_choice["avg_bits"] - rows[32768]["avg_bits"]) > 0.01


def test_sliding_window_layers_are_planned_as_holding_their_window(tmp_path):
    """A config with sliding-window layers (Gemma-3's local layers) is planned with each layer holding what the
    cache holds: the planner's fp16 bytes equal a compressed fp16 cache's memory report after a 300-token forward
    of that model, and bits per element divide by the elements held."""
    import torch
    import transformers

    import kvsqueeze
    from conftest import random_ids
    from kvsqueeze.eval.planner import plan
    from kvsqueeze.methods import parse_methods

    cfg = transformers.Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                        query_pre_attn_scalar=256, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention"])
    cfg.save_pretrained(tmp_path)
    shape = resolve_model(str(tmp_path))
    assert shape.windows == (8, None) and shape.held(300) == [7, None]
    (row,) = plan(shape, parse_methods("fp16"), [("300", 300)])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with kvsqueeze.cache_for(model, None, "fp16") as cache:
        with torch.no_grad():
            model(random_ids(1, 300, seed=1), cache=cache, use_cache=True)
        report = cache.memory_report()
    assert row["kv_bytes"] == report.total_bytes
    assert row["avg_bits"] == pytest.approx(report.avg_bits, rel=1e-12) == pytest.approx(16.0, abs=0.1)


def test_the_windows_come_from_the_config_file_named(tmp_path):
    """A config passed by its own file name is read for its windows, not the directory's config.json; a config
    that asks for sliding layers in a way the planner cannot read is refused rather than planned as full."""
    import transformers

    cfg = transformers.Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                        query_pre_attn_scalar=256, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention"])
    (tmp_path / "gemma.json").write_text(cfg.to_json_string())
    assert resolve_model(str(tmp_path / "gemma.json")).windows == (8, None)  # no config.json beside it
    unknown = {**json.loads(cfg.to_json_string()), "model_type": "not_a_transformers_model"}
    (tmp_path / "unknown.json").write_text(json.dumps(unknown))
    with pytest.raises(ValueError, match="sliding-window layers"):
        resolve_model(str(tmp_path / "unknown.json"))
    full = {k: v for k, v in unknown.items() if k not in ("layer_types", "sliding_window")}
    (tmp_path / "full.json").write_text(json.dumps(full))
    assert resolve_model(str(tmp_path / "full.json")).windows is None  # unknown type, nothing sliding: full


def test_a_budget_is_planned_with_the_windows_of_the_model_planned(tiny_model_dir, tiny_recipe_dir, tmp_path):
    """A recipe from before its fingerprint named its layers' windows takes the planned model's; a recipe whose
    windows differ from the planned model's is refused, so a budget is never chosen for tokens the plan does
    not count."""
    import dataclasses
    import shutil

    from kvsqueeze.eval.planner import _budget_recipe
    from kvsqueeze.methods import MethodError, parse_methods
    from kvsqueeze.recipe import Recipe

    shape = resolve_model(str(tiny_model_dir))
    specs = parse_methods("nuq@3.5:chan")
    assert _budget_recipe(shape, specs, str(tiny_recipe_dir)).meta["model"]["fingerprint"]["layer_windows"] == \
        [None] * shape.layers
    old = tmp_path / "old"
    shutil.copytree(tiny_recipe_dir, old)
    recipe = Recipe.load(old)
    del recipe.meta["model"]["fingerprint"]["layer_windows"]
    recipe.save(old)
    sliding = dataclasses.replace(shape, windows=(8,) + (None,) * (shape.layers - 1))
    assert _budget_recipe(sliding, specs, str(old)).meta["model"]["fingerprint"]["layer_windows"] == \
        [8] + [None] * (shape.layers - 1)
    with pytest.raises(MethodError, match="hold windows"):
        _budget_recipe(sliding, specs, str(tiny_recipe_dir))


def test_chunked_attention_is_refused_when_only_the_config_class_names_it(tmp_path):
    """A Llama-4 config.json written before transformers named each layer's kind holds no `layer_types`: the
    config class fills them in (chunked attention), and the planner refuses them rather than plan sliding windows."""
    import transformers

    cfg = json.loads(transformers.Llama4TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_chunk_size=8, num_local_experts=1,
        interleave_moe_layer_step=1).to_json_string())
    cfg.pop("layer_types", None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="chunked attention"):
        resolve_model(str(tmp_path))
