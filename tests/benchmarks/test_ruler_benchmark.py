"""`benchmarks/ruler.py --summarize-only`: the JSON rebuilt from an answers file, paired with fp16 question by
question, in all and split by what each question asks for."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

import pytest

from conftest import load_benchmark


def _summarize(ruler, rows, methods: str, tmp_path, monkeypatch) -> dict:
    """`ruler.py --summarize-only` over these answers (one run: model "m" at 4K), its JSON read back."""
    answers = tmp_path / "answers.jsonl"
    answers.write_text("".join(json.dumps(asdict(a)) + "\n" for a in rows))
    out = tmp_path / "ruler.json"
    monkeypatch.setattr(sys, "argv", ["ruler.py", "--summarize-only", "--run", "m:recipe:4096:many", "--methods",
                                      methods, "--answers", str(answers), "--json", str(out), "--plot",
                                      str(tmp_path / "ruler.png")])
    ruler.main()
    return json.loads(out.read_text())


def test_summary_pairs_questions_and_splits_them_by_what_they_ask(tmp_path, monkeypatch):
    from kvsqueeze.eval.ruler_eval import Answer

    ruler = load_benchmark("ruler")
    rows = []
    for item in range(4):
        for task, ref, mine in (("niah_single_number", 1.0, 1.0), ("niah_multivalue", 1.0, 0.25 * item)):
            for method, score in (("fp16", ref), ("q3.5", mine)):
                rows.append(Answer("m", method, "dense-prefill", task, 4096, 0, 7, 100, score, "x", ("x",), item))
    data = _summarize(ruler, rows, "fp16,q3.5", tmp_path, monkeypatch)
    (both,) = data["paired"]
    assert both["questions"] == 8 and both["diff"] == pytest.approx(-62.5 / 2)
    groups = {r["answers"]: r for r in data["paired_by_answers"]}
    assert groups["one"]["questions"] == 4 and groups["one"]["diff"] == 0.0
    several = groups["several"]
    assert several["questions"] == 4 and several["diff"] == pytest.approx(-62.5)
    assert several["ci95"] is None and several["samples"] == 1  # one sample: no interval
    assert several["on_fp16_right"] == pytest.approx(37.5)


def test_tables_compare_the_methods_on_the_questions_every_method_has_answered(tmp_path, monkeypatch):
    """A sample some method is still answering stays out of every table until each method has answered it, so the
    methods' rows and the plot compare the same questions; the JSON counts the answers left out."""
    from kvsqueeze.eval.ruler_eval import Answer

    ruler = load_benchmark("ruler")
    rows = [Answer("m", method, "dense-prefill", "vt", 4096, sample, 7, 100, score, "x", ("x",), item)
            for sample, methods in ((0, ("fp16", "q3.5", "nuq3-1%")), (1, ("fp16", "nuq3-1%")))
            for method in methods for item in range(3)
            for score in [1.0 if method == "fp16" or sample == 0 else 0.0]]
    data = _summarize(ruler, rows, "fp16,nuq3-1%,q3.5", tmp_path, monkeypatch)
    assert data["config"]["answers_pending"] == 6  # sample 1's answers of fp16 and nuq3-1%
    assert {r["method"]: r["questions"] for r in data["paired"]} == {"nuq3-1%": 3, "q3.5": 3}
    assert {r["method"]: r["score"] for r in data["rows"] if r["task"] == "average"} == {
        "fp16": 100.0, "nuq3-1%": 100.0, "q3.5": 100.0}  # sample 1's zeros of nuq3-1% not yet in


def test_a_run_refuses_a_recipe_other_than_the_one_its_earlier_answers_came_from(tiny_recipe, tmp_path, monkeypatch):
    """The timing records name the recipe each model's answers came from; a run given another recipe for that
    model stops before loading any model (its answers would join the others under the same method names), and
    the same recipe goes on to the model."""
    ruler = load_benchmark("ruler")
    recipe_dir = tiny_recipe.save(tmp_path / "recipe")
    digest = json.loads((recipe_dir / "recipe.json").read_text())["tensors_sha256"]
    answers = tmp_path / "answers.jsonl"
    answers.write_text("")
    timing = tmp_path / "answers_timing.jsonl"

    def run(model: str):
        monkeypatch.setattr(sys, "argv", ["ruler.py", "--run", f"{model}:{recipe_dir}:4096:many", "--methods",
                                          "fp16,q3.5", "--answers", str(answers), "--json", str(tmp_path / "r.json"),
                                          "--plot", str(tmp_path / "r.png"), "--prefills", ""])
        ruler.main()

    monkeypatch.setattr("kvsqueeze.integrations.loading.load_model", _reached)
    timing.write_text(json.dumps({"model": "no-such-model", "length": 4096, "sample": 0, "answers": 1,
                                  "seconds": 1.0, "recipe_sha256": "0" * 64}) + "\n")
    with pytest.raises(SystemExit, match="not the one the answers"):
        run("no-such-model")
    timing.write_text(json.dumps({"model": "no-such-model", "length": 4096, "sample": 0, "answers": 1,
                                  "seconds": 1.0, "recipe_sha256": digest}) + "\n")
    with pytest.raises(Reached):  # past the check, on to the model
        run("no-such-model")


def test_a_run_refuses_two_names_of_one_method_at_one_of_its_lengths_before_loading(tmp_path, monkeypatch):
    """`q3.5` at 8,192 tokens is `nuq@3.5:r32:chan:ctx8k`: naming both is refused before any model loads, though
    the two differ at the run's other length."""
    from kvsqueeze.methods import MethodError

    ruler = load_benchmark("ruler")
    monkeypatch.setattr("kvsqueeze.integrations.loading.load_model", _reached)
    monkeypatch.setattr(sys, "argv", ["ruler.py", "--run", "m:recipe:4096,8192:many", "--methods",
                                      "fp16,q3.5,nuq@3.5:r32:chan:ctx8k", "--answers", str(tmp_path / "a.jsonl"),
                                      "--json", str(tmp_path / "r.json"), "--prefills", ""])
    with pytest.raises(MethodError, match="same method"):
        ruler.main()


class Reached(Exception):
    """Raised where a run would load its model."""


def _reached(*args, **kwargs):
    raise Reached


def _rows(model="m", methods=("fp16", "q3.5"), length=4096, samples=(0,), tasks=("vt",), items=2, context="c",
          score=1.0):
    from kvsqueeze.eval.ruler_eval import Answer

    return [Answer(model, method, "dense-prefill", task, length, sample, 7, 100, score, "x", ("x",), item,
                   f"{context}{sample}{task}{item}")
            for sample in samples for task in tasks for method in methods for item in range(items)]


def test_answers_of_two_haystacks_in_one_question_slot_are_refused(tmp_path, monkeypatch):
    """A file holding answers over another haystack (or seed, layout, task set) for the same sample: their
    questions would be clustered and paired with this run's as one sample. The summary stops, naming the slot."""
    ruler = load_benchmark("ruler")
    rows = _rows() + _rows(methods=("fp16",), context="other")
    with pytest.raises(SystemExit, match=r"sample 0, vt #0 was answered over two contexts"):
        _summarize(ruler, rows, "fp16,q3.5", tmp_path, monkeypatch)


def test_a_method_missing_at_one_length_leaves_the_other_lengths_whole(tmp_path, monkeypatch):
    """A method run at 4K only: the 8K questions every other method answered still make the 8K tables (before,
    the whole length dropped out), and the JSON names what is missing."""
    ruler = load_benchmark("ruler")
    rows = _rows(methods=("fp16", "q3.5", "int4")) + _rows(methods=("fp16", "q3.5"), length=8192)
    data = _summarize(ruler, rows, "fp16,q3.5,int4", tmp_path, monkeypatch)
    assert {(r["method"], r["length"]) for r in data["paired"]} == {("q3.5", 4096), ("int4", 4096), ("q3.5", 8192)}
    assert data["config"]["missing"] == [["m", 8192, "int4"]]
    assert data["config"]["runs"] == [{"model": "m", "recipe": "recipe", "lengths": [4096, 8192], "layout": "many"}]


def test_a_sample_no_method_has_finished_stays_out_whole(tmp_path, monkeypatch):
    """Sample 1's second context (cwe) not started by any method: its other questions, answered by every method,
    would give it an average over fewer tasks than the row claims. It waits, named in `samples_partial`."""
    ruler = load_benchmark("ruler")
    rows = _rows(samples=(0,), tasks=("vt", "cwe")) + _rows(samples=(1,), tasks=("vt",), score=0.0)
    data = _summarize(ruler, rows, "fp16,q3.5", tmp_path, monkeypatch)
    assert data["config"]["samples_partial"] == [["m", 4096, 1]]
    assert data["config"]["answers_pending"] == 4
    average = {r["method"]: (r["score"], r["samples"]) for r in data["rows"] if r["task"] == "average"}
    assert average == {"fp16": (100.0, 1), "q3.5": (100.0, 1)}


def test_a_run_of_one_model_keeps_the_other_models_tables(tmp_path, monkeypatch):
    """`--run` names one model (a long run of the 32K model alone), the file holds two: the JSON's runs, which
    the reports build their tables from, list both, each with the recipe and layout it was last summarized with."""
    ruler = load_benchmark("ruler")
    out = tmp_path / "ruler.json"
    out.write_text(json.dumps({"config": {"runs": [{"model": "other", "recipe": "theirs", "lengths": [4096],
                                                     "layout": "many"}]}}))
    rows = _rows() + _rows(model="other", length=8192)
    data = _summarize(ruler, rows, "fp16,q3.5", tmp_path, monkeypatch)
    assert data["config"]["runs"] == [
        {"model": "m", "recipe": "recipe", "lengths": [4096], "layout": "many"},
        {"model": "other", "recipe": "theirs", "lengths": [8192], "layout": "many"}]
    assert {r["model"] for r in data["paired"]} == {"m", "other"}


def test_a_label_whose_answers_came_from_two_methods_or_recipes_is_refused(tmp_path, monkeypatch):
    """A preset resolved to another budget part way through a campaign, or a recipe calibrated again: the
    label's answers at one length came from two methods, and the summary stops naming the cell."""
    from dataclasses import replace

    ruler = load_benchmark("ruler")
    rows = [replace(a, spec="nuq@3.5:r32:chan:ctx4k" if a.item else "nuq@3.49:r32:chan:ctx4k")
            if a.method == "q3.5" else a for a in _rows()]
    with pytest.raises(SystemExit, match=r"m q3.5 4096 holds answers of two specs"):
        _summarize(ruler, rows, "fp16,q3.5", tmp_path, monkeypatch)
    rows = [replace(a, recipe="aa" if a.item else "bb") if a.method == "q3.5" else a for a in _rows()]
    with pytest.raises(SystemExit, match=r"two recipes"):
        _summarize(ruler, rows, "fp16,q3.5", tmp_path, monkeypatch)
    rows = [replace(a, spec="nuq@3.5:r32:chan:ctx4k", recipe="aa", dtype="float32") for a in _rows()]
    assert _summarize(ruler, rows, "fp16,q3.5", tmp_path, monkeypatch)["paired"]


def test_a_mistyped_task_or_no_samples_is_refused_before_anything_loads(tmp_path, monkeypatch):
    """A typo in --tasks gave a summary of no answers (or stopped after the models loaded); --samples 0 ran
    nothing. Both are refused at once, naming the tasks there are."""
    ruler = load_benchmark("ruler")
    for extra in (["--tasks", "niah_single_numbr"], ["--samples", "0"]):
        monkeypatch.setattr(sys, "argv", ["ruler.py", "--summarize-only", "--answers", str(tmp_path / "a.jsonl"),
                                          "--json", str(tmp_path / "r.json"), *extra])
        with pytest.raises(SystemExit):
            ruler.main()
        assert not (tmp_path / "r.json").exists()
