"""Hostile input: values a cache cannot hold, text that is not text, options out of range. Each ends in a clear
error before any expensive work, naming the problem and the fix; none gives a number or a traceback."""

from __future__ import annotations

import re

import pytest
import torch

from conftest import random_ids, tiny_model
from kvsqueeze import cache_for
from kvsqueeze.cli import main
from kvsqueeze.eval.texts import TextError, load_text
from kvsqueeze.integrations.layers import CacheValueError


def _without_tensor_probes(recipe):
    import copy

    out = copy.deepcopy(recipe)
    del out.meta["model"]["fingerprint"]["weights_probe"]
    return out


def _scaled(part: str, factor: float):
    model = tiny_model("llama", seed=0)
    with torch.no_grad():
        getattr(model.model.layers[1].self_attn, part).weight.mul_(factor)
    return model


@pytest.mark.parametrize("method", ["fp16", "nuq3-1%", "nuq3-1%:r16"])
def test_values_beyond_fp16_are_refused_by_every_cache_with_the_layer_named(tiny_recipe, method):
    """A float32 model whose values exceed 65,504 keeps finite logits in DynamicCache; kvsqueeze's caches store
    fp16 parts, so they refuse at the layer instead of returning NaN attention. (The recipe is the tiny model's
    without its every-tensor probes, which would refuse the scaled model first as another model.)"""
    model = _scaled("v_proj", 1e7)
    ids = random_ids(1, 24, seed=3)
    recipe = _without_tensor_probes(tiny_recipe)
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()  # the model itself is fine in float32
        cache = cache_for(model, recipe, method)
        with pytest.raises(CacheValueError, match=r"layer 1: keys or values reach .*65,504.*DynamicCache"):
            model(ids, past_key_values=cache, use_cache=True)


def test_a_single_step_beyond_fp16_is_refused_on_the_cpu(tiny_recipe):
    """Decode steps are checked too: all layers at once after the last one, before the logits are returned."""
    model = tiny_model("llama", seed=0)
    ids = random_ids(1, 16, seed=4)
    with torch.no_grad():
        cache = cache_for(model, tiny_recipe, "nuq3-1%")
        model(ids, past_key_values=cache, use_cache=True)
        model.model.layers[1].self_attn.v_proj.weight.mul_(1e7)
        with pytest.raises(CacheValueError, match="layer 1"):
            model(ids[:, :1], past_key_values=cache, use_cache=True)


def test_nan_keys_are_named_as_the_model_s_own(tiny_recipe):
    model = tiny_model("llama", seed=0)
    with torch.no_grad():
        model.model.embed_tokens.weight[5] = float("nan")
        ids = torch.tensor([[1, 5, 7, 9]])
        cache = cache_for(model, None, "fp16")
        with pytest.raises(CacheValueError, match="layer 0: the model's keys or values hold NaN/Inf"):
            model(ids, past_key_values=cache, use_cache=True)


@pytest.mark.parametrize("tokens", [1, 300])  # a decode step, and a prefill past the in-place reductions' size
@pytest.mark.parametrize("part", ["k_proj", "v_proj"])
def test_nan_in_keys_or_values_alone_is_refused(part, tokens):
    from kvsqueeze.integrations.layers import Fp16Layer

    layer = Fp16Layer()
    layer.layer_idx = 2
    k, v = torch.randn(1, 4, tokens, 64), torch.randn(1, 4, tokens, 64)
    (k if part == "k_proj" else v)[0, 1, tokens - 1, 5] = float("nan")
    with pytest.raises(CacheValueError, match="layer 2: the model's keys or values hold NaN/Inf"):
        layer.update(k, v)
    (k if part == "k_proj" else v)[0, 1, tokens - 1, 5] = 7e4
    with pytest.raises(CacheValueError, match="layer 2: keys or values reach 7e\\+04"):
        layer.update(k, v)


def test_text_that_is_not_utf8_or_not_text_is_refused(tmp_path, text_file):
    utf16 = tmp_path / "u16.txt"
    utf16.write_text(text_file.read_text(), encoding="utf-16")
    with pytest.raises(TextError, match="UTF-16.*--encoding utf-16"):
        load_text(str(utf16))
    assert load_text(str(utf16), "utf-16").evaluation  # with its encoding named, it reads
    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(256)) * 64)
    with pytest.raises(TextError, match="not valid utf-8.*--encoding"):
        load_text(str(binary))
    with pytest.raises(TextError, match="binary data"):
        load_text(str(binary), "latin-1")
    latin = tmp_path / "latin.txt"
    latin.write_bytes(("caf\xe9 " * 400 + "\n\n").encode("latin-1") * 8)
    with pytest.raises(TextError, match="not valid utf-8"):
        load_text(str(latin))
    assert "café" in load_text(str(latin), "latin-1").calibration
    with pytest.raises(TextError, match="not an encoding"):
        load_text(str(latin), "no-such-codec")


@pytest.mark.parametrize("argv, match", [
    (["calibrate", "--outliers", "200"], r"--outliers '200'.*\[0, 50\)"),
    (["calibrate", "--outliers", "-1"], r"--outliers '-1'.*\[0, 50\)"),
    (["calibrate", "--avg-bits", "99"], "between 2 and 16"),
])
def test_calibrate_options_are_checked_before_the_model_loads(tmp_path, capsys, argv, match):
    """A model that does not exist shows the order: the option's error comes first."""
    rc = main([*argv, "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "r")])
    assert rc == 2
    assert re.search(match, capsys.readouterr().err)


@pytest.mark.parametrize("argv", [
    ["calibrate", "--sinks", "-3", "--out", "r"],
    ["calibrate", "--samples", "0", "--out", "r"],
    ["calibrate", "--seqlen", "1", "--out", "r"],
    ["eval", "--max-windows", "0"],
    ["generate", "--prompt", "x", "--max-new-tokens", "-1"],
    ["ruler", "--samples", "0"],
    ["memory", "--batch", "0"],
])
def test_numeric_options_out_of_range_are_refused_when_parsed(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "out of range" in capsys.readouterr().err


def test_an_output_that_is_a_file_is_refused_before_calibration(tmp_path, capsys):
    out = tmp_path / "a-file"
    out.write_text("not a directory")
    assert main(["calibrate", "--model", str(tmp_path / "no-model"), "--out", str(out)]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    assert out.read_text() == "not a directory"


def test_lengths_past_the_model_s_context_are_refused(tiny_model_dir, text_file, capsys):
    rc = main(["eval", "--model", str(tiny_model_dir), "--text", str(text_file), "--methods", "fp16",
               "--seqlen", "4096"])
    assert rc == 2
    assert "exceed(s) the model's 1024-token context" in capsys.readouterr().err


def test_a_binary_text_file_is_refused_by_eval(tiny_model_dir, tmp_path, capsys):
    blob = tmp_path / "blob.txt"
    blob.write_bytes(bytes(range(256)) * 64)
    assert main(["eval", "--model", str(tiny_model_dir), "--text", str(blob), "--methods", "fp16"]) == 2
    assert "not valid utf-8" in capsys.readouterr().err


def test_key_slots_past_the_channels_are_refused(capsys):
    assert main(["memory", "--methods", "nuq3-1%:kslots9999"]) == 2
    assert "more than the model's" in capsys.readouterr().err


def test_an_empty_cache_reports_no_bits_per_element(tiny_recipe):
    cache = cache_for(tiny_model("llama", seed=0), tiny_recipe, "nuq3-1%")
    text = cache.memory_report().format()
    assert "no tokens cached yet" in text and "bits/element" not in text


def test_nan_weights_are_named_as_such_not_as_an_unsupported_architecture():
    from kvsqueeze.integrations.preflight import UnsupportedModelError, preflight

    model = tiny_model("llama", seed=0)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("inf")
    with pytest.raises(UnsupportedModelError, match=r"NaN/Inf weights \(model.layers.1.mlp.up_proj.weight\).*broken"):
        preflight(model)
