"""`benchmarks/transfer.py`: which texts count as in-domain, its summary over cells, resuming, and refusals made
before any model is loaded."""

from __future__ import annotations

import json

import pytest

from conftest import load_benchmark


def _load():
    return load_benchmark("transfer")


def test_in_domain_is_the_calibration_text_or_a_text_of_the_mix():
    tr = _load()
    assert tr.in_domain("bbc", "bbc") and not tr.in_domain("bbc", "code")
    assert tr.in_domain("mix", "code") and tr.in_domain("mix", "es") and not tr.in_domain("mix", "plays")


def _row(calib, text, method, delta, bits=3.5):
    tr = _load()
    return {"model": "m", "calib_text": calib, "eval_text": text, "method": method, "delta_pct": delta,
            "in_domain": tr.in_domain(calib, text), "avg_bits": bits}


def test_summary_takes_the_worst_text_and_the_out_of_domain_ratio():
    tr = _load()
    rows = [_row("bbc", "bbc", "fp16", 0.0), _row("bbc", "bbc", "q3.5", 1.0), _row("bbc", "code", "q3.5", 3.0),
            _row("bbc", "plays", "q3.5", 2.0, bits=3.6),
            _row("mix", "bbc", "q3.5", 1.0), _row("mix", "code", "q3.5", 2.0), _row("mix", "plays", "q3.5", 4.5)]
    by = {(s["calib_text"], s["method"]): s for s in tr.summary(rows)}
    assert set(by) == {("bbc", "q3.5"), ("mix", "q3.5")}  # fp16 is the reference, not summarised
    bbc = by[("bbc", "q3.5")]
    assert bbc["worst_delta_pct"] == 3.0 and bbc["worst_text"] == "code" and bbc["in_domain_delta_pct"] == 1.0
    assert bbc["out_over_in"] == 3.0 and bbc["avg_bits"] == pytest.approx((3.5 + 3.5 + 3.6) / 3, abs=1e-4)
    mix = by[("mix", "q3.5")]
    assert mix["in_domain_delta_pct"] == 1.5 and mix["worst_out_of_domain_delta_pct"] == 4.5
    assert mix["out_over_in"] == 3.0


def test_a_file_of_other_settings_is_refused_not_written_over(tmp_path):
    """Rows of other windows, length or methods are not resumed, and the run stops instead of replacing the
    file (every model's cells) with its own."""
    tr = _load()
    p = tmp_path / "t.json"
    settings = {"windows": 8, "seqlen": 2048, "methods": ["fp16", "q3.5"]}
    p.write_text(json.dumps({"settings": settings, "rows": [_row("bbc", "bbc", "q3.5", 1.0)]}))
    assert len(tr.load_rows(p, settings)) == 1
    with pytest.raises(SystemExit, match="measured with other settings"):
        tr.load_rows(p, {**settings, "windows": 4})
    assert tr.load_rows(tmp_path / "missing.json", settings) == []


@pytest.mark.parametrize("argv, message", [
    (["--eval", "bbc,wikipedia"], "unknown text 'wikipedia'; known: bbc, code"),
    (["--methods", "fp16,nuq9-1%"], "nuq9"),
    (["--windows", "0"], "--windows must be at least 1"),
])
def test_bad_arguments_are_refused_before_loading(argv, message, tmp_path):
    tr = _load()
    with pytest.raises((SystemExit, ValueError), match=message):
        tr.main([*argv, "--models", "no-such-model", "--json", str(tmp_path / "t.json")])
    assert not (tmp_path / "t.json").exists()


def test_a_stopped_cell_resumes_from_its_checkpoint(tiny_llama, tiny_recipe, tmp_path, monkeypatch):
    from kvsqueeze.eval import perplexity as P
    from kvsqueeze.eval.texts import Text
    from tests.conftest import byte_tokenizer, sample_text

    transfer = _load()
    tok, text = byte_tokenizer(), Text("t", "", sample_text(400, seed=2))
    methods = ["fp16", "nuq3-1%"]
    whole, _ = transfer.evaluate_cell(tiny_llama, tok, tiny_recipe, text, methods, 3, 64)
    ckpt = tmp_path / "checkpoints" / "cell.safetensors"
    real, calls = P.against_reference, []

    def stop_in_window_two(*a, **k):
        calls.append(1)
        if len(calls) > len(methods):
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(P, "against_reference", stop_in_window_two)
    with pytest.raises(KeyboardInterrupt):
        transfer.evaluate_cell(tiny_llama, tok, tiny_recipe, text, methods, 3, 64, ckpt)
    monkeypatch.setattr(P, "against_reference", real)
    resumed, cell = transfer.evaluate_cell(tiny_llama, tok, tiny_recipe, text, methods, 3, 64, ckpt)
    assert cell["resumed_after"] == 1 and cell["windows"] == 3
    assert resumed == whole


def test_a_method_the_model_s_cache_cannot_hold_is_recorded_as_refused_and_the_rest_evaluated(tiny_llama,
                                                                                               tiny_recipe):
    """A budget below what the model's layers must store at the cell's length is refused as a user's cache would
    refuse it; the cell evaluates the other methods, and the summary has no numbers for it."""
    from kvsqueeze.eval.texts import Text
    from tests.conftest import byte_tokenizer, sample_text

    transfer = _load()
    tok, text = byte_tokenizer(), Text("t", "", sample_text(400, seed=2))
    pairs, cell = transfer.evaluate_cell(tiny_llama, tok, tiny_recipe, text, ["fp16", "nuq@2.01:r32", "nuq3-1%"],
                                         2, 64)
    assert [name for name, _ in pairs] == ["fp16", "nuq3-1%"]
    assert list(cell["refused"]) == ["nuq@2.01:r32"] and "below what this recipe can store" in cell["refused"][
        "nuq@2.01:r32"]
    rows = [{"model": "m", "calib_text": "bbc", "eval_text": "t", "method": "nuq@2.01:r32", "in_domain": True,
             "refused": "..."}]
    assert transfer.summary(rows) == []


def test_a_recipe_other_than_the_one_of_a_model_s_cells_is_refused_before_loading(tiny_recipe, tmp_path, monkeypatch):
    """The JSON names each recipe's content digest; a run whose recipe for a model and calibration text has another
    digest than the one its cells were measured with stops before loading the model (its cells would mix two
    recipes under one name)."""
    tr = _load()
    recipe_dir = tiny_recipe.save(tr.recipe_dir(tmp_path / "recipes", "no-such-model", "bbc"))
    digest = json.loads((recipe_dir / "recipe.json").read_text())["tensors_sha256"]
    settings = {"windows": 8, "seqlen": 2048, "methods": ["fp16", "q3.5"]}
    measured = _row("bbc", "bbc", "q3.5", 1.0) | {"model": "no-such-model"}
    out = tmp_path / "t.json"
    argv = ["--models", "no-such-model", "--calib", "bbc", "--eval", "bbc,code", "--methods", "fp16,q3.5",
            "--recipes", str(tmp_path / "recipes"), "--json", str(out)]
    from test_ruler_benchmark import Reached, _reached

    monkeypatch.setattr("kvsqueeze.integrations.loading.load_model", _reached)
    monkeypatch.setattr(tr, "model_windows_of", lambda name: [None])  # a model of no config: every layer full
    for named, stop in (("0" * 64, SystemExit), (digest, Reached)):  # the same recipe goes on, to the model
        out.write_text(json.dumps({"settings": settings, "rows": [measured],
                                   "recipes": {"no-such-model/bbc": {"tensors_sha256": named}}}))
        with pytest.raises(stop) as stopped:
            tr.main(argv)
        assert stop is Reached or "not the one the JSON's cells" in str(stopped.value)


def test_a_resumed_run_keeps_every_entry_of_the_json_it_does_not_write():
    """Superseded cells, outlier shares and entries a later version adds stay in the file a resumed run rewrites;
    only what it writes anew is left to it (a run once dropped the superseded Gemma cells)."""
    old = {"machine": "A", "threads": 2, "settings": {}, "command": "c", "rows": [1], "summary": [2],
           "recipes": {"m/bbc": {"tensors_sha256": "x"}}, "cells": {"m/bbc/bbc": {}, "m/bbc/code": {"machine": "B"}},
           "outliers": {"m": 1}, "superseded": {"rows": [3], "why": "..."}, "added_later": [4]}
    kept = _load().carried(old)
    assert set(kept) == {"recipes", "cells", "outliers", "superseded", "added_later"}
    assert kept["superseded"] == old["superseded"] and kept["added_later"] == [4]
    assert {k: c["machine"] for k, c in kept["cells"].items()} == {"m/bbc/bbc": "A", "m/bbc/code": "B"}


def test_cells_whose_presets_resolve_otherwise_now_are_moved_aside_and_measured_again():
    """A cell measured when `q3.5` held a 32-token window on a model whose local layers keep 512 tokens (now 8) is
    moved to `superseded` with why, its rows and its cell entry together, and is no longer done; the cells of a
    model whose presets resolve as measured stay, and so do the superseded cells of earlier runs."""
    tr = _load()

    def row(model, calib, text, method, resolved):
        return _row(calib, text, method, 1.0) | {"model": model, "resolved": resolved}

    rows = [row("g", "bbc", "bbc", "q4.5", "nuq@4.5:r32:chan"), row("g", "bbc", "bbc", "q3.5", "nuq@3.5:r32:chan"),
            row("g", "bbc", "code", "nuq3-1%", "nuq3-1%"), row("s", "bbc", "bbc", "q3.5", "nuq@3.5:r32:chan")]
    result = {"cells": {"g/bbc/bbc": {"machine": "A"}, "g/bbc/code": {}, "s/bbc/bbc": {}},
              "superseded": {"why": "earlier", "rows": [], "cells": {}}}
    kept = tr.supersede_moved(result, rows, {"g": [512, None], "s": [None, None]}, 2048)
    assert kept == [rows[2], rows[3]]
    assert set(result["cells"]) == {"g/bbc/code", "s/bbc/bbc"}
    earlier, moved = result["superseded"]
    assert earlier["why"] == "earlier"
    assert moved["rows"] == rows[:2] and moved["cells"] == {"g/bbc/bbc": {"machine": "A"}}
    assert "q3.5 was nuq@3.5:r32:chan, now nuq@3.5:r8:chan" in moved["why"]  # every method that moved, named
    assert "q4.5 was nuq@4.5:r32:chan, now nuq@4.5:r8:chan" in moved["why"]
    assert tr.supersede_moved(result, kept, {"g": [512, None], "s": [None, None]}, 2048) == kept  # nothing more
