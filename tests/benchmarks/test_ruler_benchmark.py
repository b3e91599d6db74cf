"""`benchmarks/ruler.py --summarize-only`: the JSON rebuilt from an answers file, paired with fp16 question by
question, in all and split by what each question asks for."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

import pytest

from conftest import load_benchmark


def test_summary_pairs_questions_and_splits_them_by_what_they_ask(tmp_path, monkeypatch):
    from kvsqueeze.eval.ruler_eval import Answer

    ruler = load_benchmark("ruler")
    rows = []
    for item in range(4):
        for task, ref, mine in (("niah_single_number", 1.0, 1.0), ("niah_multivalue", 1.0, 0.25 * item)):
            for method, score in (("fp16", ref), ("q3.5", mine)):
                rows.append(Answer("m", method, "dense-prefill", task, 4096, 0, 7, 100, score, "x", ("x",), item))
    answers = tmp_path / "answers.jsonl"
    answers.write_text("".join(json.dumps(asdict(a)) + "\n" for a in rows))
    out = tmp_path / "ruler.json"
    monkeypatch.setattr(sys, "argv", ["ruler.py", "--summarize-only", "--run", "m:recipe:4096:many", "--methods",
                                      "fp16,q3.5", "--answers", str(answers), "--json", str(out), "--plot",
                                      str(tmp_path / "ruler.png")])
    ruler.main()
    data = json.loads(out.read_text())
    (both,) = data["paired"]
    assert both["questions"] == 8 and both["diff"] == pytest.approx(-62.5 / 2)
    groups = {r["answers"]: r for r in data["paired_by_answers"]}
    assert groups["one"]["questions"] == 4 and groups["one"]["diff"] == 0.0
    several = groups["several"]
    assert several["questions"] == 4 and several["diff"] == pytest.approx(-62.5)
    assert several["ci95"][0] <= -62.5 <= several["ci95"][1] and several["on_fp16_right"] == pytest.approx(37.5)
