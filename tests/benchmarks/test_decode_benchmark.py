"""`benchmarks/decode.py` at tiny sizes: the whole-step rows with their settling, and greedy decoding after one
exact prefill shared by every cache (a `StaticCache` filled from it must decode what a `DynamicCache` does)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "decode.py"


def _bench():
    spec = importlib.util.spec_from_file_location("decode_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_step_rows_time_every_variant_after_settling(tmp_path):
    out = tmp_path / "decode.json"
    _bench().main(["--contexts", "80", "--methods", "nuq3-1%", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                   "--recipe", "", "--step", "--no-reference", "--rounds", "2", "--settle-ms", "1",
                   "--json", str(out)])
    data = json.loads(out.read_text())
    assert {r["method"] for r in data["steps"]} == {"nuq3-1%", "dense-float32", "static-float32", "dense-bfloat16",
                                                    "static-bfloat16"}
    assert all(r["repeats"] == 2 and r["median_ms"] > 0 for r in data["steps"])
    assert "after 1 ms of untimed calls" in data["step_timing"] and data["settle_ms"] == 1


def test_a_shared_prefill_fills_every_cache_and_the_static_one_decodes_as_the_dynamic_one(tiny_model_dir,
                                                                                        tiny_recipe_dir, tmp_path):
    bench = _bench()
    common = ["--contexts", "64", "--methods", "nuq3-1%", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
              "--recipe", str(tiny_recipe_dir), "--no-reference", "--rounds", "1", "--e2e", "--model",
              str(tiny_model_dir), "--prompt", "96", "--new", "6", "--e2e-methods", "nuq3-1%",
              "--quantized-cache-bits", ""]
    out = tmp_path / "shared.json"
    bench.main(common + ["--e2e-prefill", "shared", "--json", str(out)])
    rows = {r["cache"]: r for r in json.loads(out.read_text())["e2e"]}
    assert set(rows) == {"DynamicCache", "StaticCache", "kvsqueeze nuq3-1% (fused)"}
    assert all("shared exact prefill of 95 tokens" in r["prefill"] and r["decode_tokens_per_s"] > 0
               for r in rows.values())
    out = tmp_path / "own.json"
    bench.main(common + ["--json", str(out)])
    own = {r["cache"]: r for r in json.loads(out.read_text())["e2e"]}
    assert all("prefill_s" in r and "prefill" not in r for r in own.values())
    # the prompt fits one prefill chunk: the exact prefill is the model's own forward, so the caches filled from
    # it decode the tokens each cache decodes after prefilling the prompt itself
    assert rows["DynamicCache"]["tokens"] == own["DynamicCache"]["tokens"] == rows["StaticCache"]["tokens"]
    assert len(own["DynamicCache"]["tokens"]) == 7
    out = tmp_path / "alone.json"
    bench.main(common + ["--e2e-baselines", "", "--json", str(out)])
    (row,) = json.loads(out.read_text())["e2e"]
    assert row["cache"] == "kvsqueeze nuq3-1% (fused)" and "tokens_equal_to_dynamic_cache" not in row
