"""The serving benchmarks' shared pieces (benchmarks/common.py) and the byte count vllm_quality.py reports."""

from __future__ import annotations

import argparse
import json

import pytest

from conftest import load_benchmark


def test_each_serving_benchmark_writes_its_part_and_keeps_the_others(tmp_path):
    common = load_benchmark("common")
    out = tmp_path / "vllm.json"
    out.write_text(json.dumps({"capacity_ratio": 4.1, "quality": {"old": 1}}))
    whole = common.merge_json(out, load_test={"errors": 0}, quality={"new": 2})
    assert whole == json.loads(out.read_text())
    written = whole.pop("written")
    assert whole == {"capacity_ratio": 4.1, "quality": {"new": 2}, "load_test": {"errors": 0}}
    # each part names the code that wrote it; a part written before then names none
    assert set(written) == {"load_test", "quality"} and written["quality"]["commit"] == common.commit()
    from pathlib import Path

    if (Path(common.__file__).resolve().parent.parent / ".git").exists():  # a checkout names its commit
        assert common.commit() != "unknown"
    assert not list(tmp_path.glob("*.tmp"))  # written whole, by a rename


def test_serving_setup_refuses_a_missing_vllm_environment_and_resolves_the_served_name(tmp_path, tiny_recipe_dir):
    common = load_benchmark("common")
    ap = argparse.ArgumentParser()
    common.serving_arguments(ap)
    args = ap.parse_args(["--recipe", str(tiny_recipe_dir), "--method", "nuq3-1%",
                          "--vllm-python", str(tmp_path / "none" / "python")])
    with pytest.raises(SystemExit, match="make vllm-setup"):
        common.serving_setup(args)
    args.vllm_python = __import__("sys").executable
    py, recipe, served = common.serving_setup(args)
    assert served == "nuq3-1%:kslots1" and recipe == str(tiny_recipe_dir.resolve())  # 1% of 32 channels


def test_page_bytes_reported_are_the_layouts_and_the_registry_s(tiny_recipe_dir):
    from kvsqueeze.serving.settings import ServingConfig

    quality = load_benchmark("vllm_quality")
    config = ServingConfig(str(tiny_recipe_dir), "nuq3-1%")
    sizes = quality.token_bytes(config, layers=2, channels=32, head_dim=16, block_size=16)
    pages = sum(config.layout(layer, 32, 16, 16).page_bytes for layer in range(2)) / 16
    assert sizes["page_bytes_per_token"] == pages
    assert sizes["page_data_equals_registry"] and sizes["registry_pointer_bytes_per_token"] == 0
    assert sizes["registry_bytes_per_token"] == sizes["page_bytes_per_token"] - sizes["page_overhead_bytes_per_token"]
    assert "window" not in sizes
    windowed = quality.token_bytes(ServingConfig(str(tiny_recipe_dir), "nuq3-1%:r8"), layers=2, channels=32,
                                   head_dim=16, block_size=16)["window"]
    # a window page of 16 tokens x 2 layers x keys and values x 32 channels x fp16 would outgrow 16 tokens' pages
    # (and pad every block to it): it takes as many tokens as fit in one block of them instead
    block = 16 * pages
    assert 16 * 2 * 2 * 32 * 2 > block
    tokens = windowed["page_tokens"]
    assert tokens < 16 and tokens * 2 * 2 * 32 * 2 <= block < 2 * tokens * 2 * 2 * 32 * 2
    assert windowed["page_bytes"] == tokens * 2 * 2 * 32 * 2 and windowed["block_bytes"] == block
    assert not windowed["block_grows"] and windowed["pages_per_decoding_sequence"] == -(-8 // tokens) + 1
    assert windowed["registry_bytes"] == 8 * 2 * 2 * 32 * 2
