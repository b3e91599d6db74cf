"""`benchmarks/context_cost.py`: its line through ms per token against context, and its refusals, without a model."""

from __future__ import annotations

import pytest

from conftest import load_benchmark


def _load():
    return load_benchmark("context_cost")


def test_the_fit_recovers_slope_and_intercept_per_cache():
    cc = _load()
    rows = [{"cache": "a", "context": n, "ms_per_token": 10 + 0.5 * n / 1000} for n in (1024, 4096, 16384)]
    rows += [{"cache": "b", "context": n, "ms_per_token": 3 + 2 * n / 1000} for n in (1024, 2048)]
    rows += [{"cache": "c", "context": 1024, "ms_per_token": 7.0}]  # one point: no line
    fits = cc.fits(rows)
    assert set(fits) == {"a", "b"}
    assert fits["a"]["slope_ms_per_1k_tokens"] == pytest.approx(0.5) and fits["a"]["intercept_ms"] == pytest.approx(10)
    assert fits["b"]["slope_ms_per_1k_tokens"] == pytest.approx(2) and fits["b"]["contexts"] == [1024, 2048]


def test_unknown_llama_cache_types_are_refused_before_any_loading():
    cc = _load()
    with pytest.raises(SystemExit, match="unknown q5_1; known: f16, q8_0, q4_0"):
        cc.main(["--llama-types", "f16,q5_1", "--json", "/nonexistent/x.json"])


def test_a_file_of_another_machine_or_settings_is_refused_before_loading(tmp_path):
    """Lengths measured on another machine (or with other threads, recipe, model) would join this run's in one
    slope: refused before any model loads, naming what differs."""
    import json

    cc = _load()
    out = tmp_path / "cc.json"
    out.write_text(json.dumps({"rows": [{"cache": "DynamicCache", "context": 1024, "ms_per_token": 1.0}],
                               "machine": "another machine", "model": "smollm2-135m", "recipe": "out/recipe",
                               "threads": 2, "new_tokens": 12}))
    with pytest.raises(SystemExit, match="machine 'another machine', here"):
        cc.main(["--json", str(out), "--llama-types", ""])
