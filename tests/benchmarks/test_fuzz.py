"""`benchmarks/fuzz.py`: a sample of its mutated recipes, options and method names, run here on the tiny recipe,
ends in a clear error or an unchanged result."""

from __future__ import annotations

import importlib.util
import itertools
import shutil
from pathlib import Path

import torch

from kvsqueeze.recipe import Recipe

ROOT = Path(__file__).resolve().parents[2]


def _fuzz():
    spec = importlib.util.spec_from_file_location("fuzz", ROOT / "benchmarks" / "fuzz.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_sample_of_the_fuzz_cases_ends_clear_or_unchanged(tiny_recipe_dir, tmp_path):
    fuzz = _fuzz()
    base = tmp_path / "recipe"
    shutil.copytree(tiny_recipe_dir, base)
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(2)) * 2
    baseline = fuzz.outputs(Recipe.load(base), x)
    sources = (fuzz.recipe_cases(base, baseline, x), fuzz.cli_cases(tmp_path), fuzz.name_cases())
    sample = [c for source in sources for c in itertools.islice(source, 0, None, 40)]
    outcomes = {label: fuzz.run_case(fn) for label, fn in sample}
    bad = {k: v for k, v in outcomes.items() if v[0] not in ("clear", "same")}
    assert not bad, bad
    assert sum(v[0] == "clear" for v in outcomes.values()) > len(sample) // 2

