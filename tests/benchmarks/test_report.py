"""README.md and docs/results.md carry the tables `benchmarks/report.py` writes from benchmarks/results/*.json."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _report():
    spec = importlib.util.spec_from_file_location("report", ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_documents_tables_are_the_json_results():
    assert _report().main(["--check"]) == 0


def test_a_changed_table_is_found(tmp_path):
    report = _report()
    text = (ROOT / "docs" / "results.md").read_text()
    assert "<!-- report:ladder-headline -->" in text
    edited = text.replace("| `nuq3-1%` |", "| `nuq3-1%` (edited) |", 1)
    assert report.fill(edited, ROOT / "benchmarks" / "results") == text  # the edit is undone from the JSON
