"""`benchmarks/decode_gpu.py` runs here under Triton's interpreter at tiny sizes, so the script a GPU machine
runs once is known to work before it gets there: its check against the reference, its timing, its JSON."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "decode_gpu.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the benchmark itself is run instead")
def test_the_gpu_benchmark_runs_under_the_interpreter(tmp_path):
    assert os.environ.get("TRITON_INTERPRET") == "1"  # conftest.py, without a GPU
    spec = importlib.util.spec_from_file_location("decode_gpu", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "decode_gpu.json"
    bench.main(["--device", "cpu", "--contexts", "130", "--batches", "1,2", "--shapes", "smollm2-135m",
                "--methods", "nuq3-1%", "--rounds", "1", "--e2e-context", "40", "--e2e-new", "2",
                "--e2e-layers", "1", "--random-model", "--json", str(out)])
    data = json.loads(out.read_text())
    kinds = {(r["batch"], r["method"], r["what"]) for r in data["rows"]}
    assert kinds == ({(b, m, w) for b in (1, 2) for m in ("nuq3-1%", "dense-bfloat16") for w in ("attention", "step")}
                     | {(b, "static-bfloat16", "step") for b in (1, 2)})
    assert all(r["max_abs_error_vs_reference"] < 5e-5 for r in data["rows"] if r["method"] == "nuq3-1%")
    assert len(data["ratios"]) == 6 and all(v > 0 for v in data["ratios"].values())
    assert [r["cache"].split()[0] for r in data["e2e"]["rows"]] == ["DynamicCache", "StaticCache", "kvsqueeze"]
    assert "random weights" in data["e2e"]["model"] and data["machine"]["triton_interpreter"]
