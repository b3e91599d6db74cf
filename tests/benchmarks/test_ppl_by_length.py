"""`benchmarks/ppl_by_length.py`: rows from per-window records, paired with fp16 window by window, and refusals
made before any model is loaded."""

from __future__ import annotations

import math

import pytest

from conftest import load_benchmark


def _load():
    return load_benchmark("ppl_by_length")


def _rec(method, window, nll, length=4, bits=16.0):
    return {"length": length, "window": window, "method": method, "resolved": method, "nll": nll,
            "tokens": [2] * len(nll), "kld_sum": 0.0 if method == "fp16" else 0.1 * len(nll), "top1": 2 * len(nll),
            "held_bits": bits * 8, "elements": 8}


def test_rows_pair_each_method_with_fp16_on_the_same_windows():
    """Every method of a length is summarised over the windows all of them have: kivi2 has only window 1, so
    fp16 and q3.5 are taken over window 1 too (a row compared with another is on the same text)."""
    pbl = _load()
    records = [_rec("fp16", 0, [2.0, 2.0]), _rec("fp16", 1, [4.0, 4.0]),
               _rec("q3.5", 0, [2.2, 2.2], bits=3.5), _rec("q3.5", 1, [4.2, 4.2], bits=3.5),
               _rec("kivi2", 1, [5.0, 5.0], bits=4.0)]
    rows = {r["method"]: r for r in pbl.aggregate(records, ["fp16", "q3.5", "kivi2"], [4])}
    assert rows["fp16"]["ppl"] == pytest.approx(math.exp(8 / 4), rel=1e-4) and rows["fp16"]["ci95"] is None
    q = rows["q3.5"]
    assert q["windows"] == 1 and q["tokens"] == 4 and q["avg_bits"] == 3.5
    assert q["delta_pct"] == pytest.approx(100 * math.expm1(0.4 / 4), abs=1e-3)
    assert q["ci95"][0] <= q["delta_pct"] <= q["ci95"][1] and q["kld_mean"] == pytest.approx(0.2 / 4)
    k = rows["kivi2"]
    assert k["windows"] == 1 and k["delta_pct"] == pytest.approx(100 * math.expm1(2.0 / 4), abs=1e-3)
    both = {r["method"]: r["windows"] for r in pbl.aggregate(records[:4], ["fp16", "q3.5"], [4])}
    assert both == {"fp16": 2, "q3.5": 2}
    # a run over fewer methods keeps the other methods' rows of the records
    assert [r["method"] for r in pbl.aggregate(records, ["fp16"], [4])] == ["fp16", "q3.5", "kivi2"]


def test_windows_are_measured_so_that_a_stopped_run_covers_the_whole_text():
    """Each next window halves the largest gap left, so the first few spread over the text (ordered by topic)."""
    pbl = _load()
    assert pbl.spread_order(8) == [0, 4, 2, 6, 1, 5, 3, 7]
    for n in (1, 2, 5, 32):
        order = pbl.spread_order(n)
        assert sorted(order) == list(range(n))
    assert max(pbl.spread_order(32)[:4]) >= 24  # four windows already reach the last quarter


def test_bad_arguments_are_refused_before_loading():
    pbl = _load()
    with pytest.raises(SystemExit, match="--tokens at least the longest length"):
        pbl.main(["--lengths", "2048,32768", "--tokens", "4096", "--model", "no-such-model"])
    with pytest.raises(ValueError, match="nuq9"):
        pbl.main(["--methods", "fp16,nuq9-1%", "--model", "no-such-model"])


def test_a_recipe_other_than_the_one_of_the_logged_windows_is_refused_before_loading(tiny_recipe, tmp_path,
                                                                                     monkeypatch):
    """Window records name the recipe they were scored with; a run given another recipe stops before the model
    loads (its windows would be averaged with theirs), and the same recipe goes on to the model."""
    import json

    pbl = _load()
    recipe_dir = tiny_recipe.save(tmp_path / "recipe")
    digest = json.loads((recipe_dir / "recipe.json").read_text())["tensors_sha256"]
    out = tmp_path / "p.json"
    argv = ["--model", "no-such-model", "--recipe", str(recipe_dir), "--lengths", "64", "--tokens", "64",
            "--json", str(out)]
    from test_ruler_benchmark import Reached, _reached

    monkeypatch.setattr("kvsqueeze.integrations.loading.load_model", _reached)
    for named, stop in (("0" * 64, SystemExit), (digest, Reached)):  # the same recipe goes on, to the model
        (tmp_path / "p_windows.jsonl").write_text(json.dumps({**_rec("fp16", 0, [2.0]), "recipe_sha256": named}) + "\n")
        with pytest.raises(stop) as stopped:
            pbl.main(argv)
        assert stop is Reached or "not the one the windows" in str(stopped.value)


def test_a_run_of_another_text_or_spread_than_the_json_s_is_refused_before_loading(tiny_recipe, tmp_path,
                                                                                    monkeypatch):
    """A JSON's windows are indexed by (length, window); another --text or --tokens picks other windows under
    the same indices, which would be paired with the logged ones: refused before the model loads, and the same
    settings go on to the model."""
    import json

    pbl = _load()
    recipe_dir = tiny_recipe.save(tmp_path / "recipe")
    out = tmp_path / "p.json"
    out.write_text(json.dumps({"text": "bbc", "tokens_per_length": 128}))
    from test_ruler_benchmark import Reached, _reached

    monkeypatch.setattr("kvsqueeze.integrations.loading.load_model", _reached)
    base = ["--model", "no-such-model", "--recipe", str(recipe_dir), "--lengths", "64", "--json", str(out)]
    for extra in (["--text", "plays", "--tokens", "128"], ["--text", "bbc", "--tokens", "256"]):
        with pytest.raises(SystemExit, match="holds windows of --text bbc --tokens 128"):
            pbl.main(base + extra)
    with pytest.raises(Reached):
        pbl.main(base + ["--text", "bbc", "--tokens", "128"])


def test_each_length_names_the_machines_its_windows_were_measured_on():
    """A length's machines come from its own window records, not from the lengths a later run was given."""
    pbl = _load()
    a, b = "AMD EPYC, no AVX-512", "AMD EPYC, AVX-512"
    recs = [{"length": 2048, "window": 0, "method": "fp16", "machine": a},
            {"length": 32768, "window": 0, "method": "fp16", "machine": a},
            {"length": 32768, "window": 0, "method": "kivi2", "machine": b}]
    assert pbl.machines_by_length(recs) == {"2048": a, "32768": f"{b}; {a}"}
    with pytest.raises(SystemExit, match="names no machine"):
        pbl.machines_by_length([{"length": 2048, "window": 1, "method": "fp16"}])



def test_the_interval_is_over_windows_where_a_length_has_several():
    """A window's segments share its text and its cache: with several windows the interval takes each window as
    one cluster (its segments summed), with one window its segments, and each row says which."""
    import torch

    from kvsqueeze.eval.perplexity import paired_interval

    pbl = _load()
    records = [_rec("fp16", w, [2.0, 2.0]) for w in range(3)]
    records += [_rec("q3.5", w, [2.0 + d, 2.0 + 2 * d]) for w, d in enumerate((0.1, 0.3, 0.2))]
    (q,) = [r for r in pbl.aggregate(records, ["fp16", "q3.5"], [4]) if r["method"] == "q3.5"]
    want = paired_interval(torch.tensor([4.3, 4.9, 4.6], dtype=torch.float64), torch.tensor([4.0] * 3),
                           torch.tensor([4.0] * 3))
    assert q["ci95_over"] == "windows" and q["ci95"] == [round(x, 3) for x in want]
    (one,) = [r for r in pbl.aggregate(records[:1] + records[3:4], ["fp16", "q3.5"], [4]) if r["method"] == "q3.5"]
    assert one["windows"] == 1 and one["ci95_over"] == "segments of one window"


def test_a_run_in_segments_other_than_the_records_is_refused_before_loading(tiny_recipe, tmp_path, monkeypatch):
    """Records scored in 1,024-token segments and a run asking for 512: one window's segments would not pair."""
    import json

    pbl = _load()
    recipe_dir = tiny_recipe.save(tmp_path / "recipe")
    digest = json.loads((recipe_dir / "recipe.json").read_text())["tensors_sha256"]
    (tmp_path / "p_windows.jsonl").write_text(
        json.dumps({**_rec("fp16", 0, [2.0]), "recipe_sha256": digest, "segment": 1024}) + "\n")
    with pytest.raises(SystemExit, match=r"segments of \[1024\] tokens, this run asks for --segment 512"):
        pbl.main(["--model", "no-such-model", "--recipe", str(recipe_dir), "--lengths", "64", "--tokens", "64",
                  "--segment", "512", "--json", str(tmp_path / "p.json")])


def test_a_record_cut_short_at_the_end_is_dropped_and_one_elsewhere_refused(tmp_path):
    """A run killed while appending leaves half a line: it is dropped from the file (the next append then starts a
    whole line) with a warning; a bad line before the last stops with its number."""
    from common import read_records

    log = tmp_path / "w.jsonl"
    log.write_text('{"a": 1}\n{"a": 2}\n{"a": 3, "b"')
    with pytest.warns(UserWarning, match="cut short"):
        assert read_records(log) == [{"a": 1}, {"a": 2}]
    assert log.read_text() == '{"a": 1}\n{"a": 2}\n'
    log.write_text('{"a": 1}\n{"a": \n{"a": 3}\n')
    with pytest.raises(SystemExit, match=r"w.jsonl:2 is not a JSON record"):
        read_records(log)
    assert read_records(tmp_path / "none.jsonl") == []


def test_lengths_past_the_model_s_context_are_refused_before_any_window(tiny_recipe, tmp_path, monkeypatch):
    """A 64-token window on a model of 48 tokens of context: scored before, now refused as soon as the model is
    loaded, before any window's forward."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    pbl = _load()
    recipe_dir = tiny_recipe.save(tmp_path / "recipe")
    model = SimpleNamespace(config=LlamaConfig(max_position_embeddings=48))
    monkeypatch.setattr("kvsqueeze.integrations.loading.load_model", lambda *a, **k: (model, None))
    with pytest.raises(SystemExit, match="--lengths 64 is past no-such-model's 48-token context"):
        pbl.main(["--model", "no-such-model", "--recipe", str(recipe_dir), "--lengths", "64", "--tokens", "64",
                  "--json", str(tmp_path / "p.json")])
