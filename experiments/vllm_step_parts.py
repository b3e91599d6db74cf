"""Where the kvsqueeze backend's time goes inside vLLM's engine, and what torch's OpenMP spinning costs it.

Runs `kvsqueeze.serving.vllm_run` (8 requests of 2,048 BBC tokens or `--prompt-tokens`, greedy, bfloat16, the
3.5-bit preset, a prefill chunk of 256) in vLLM's environment once per `GOMP_SPINCOUNT` asked for (`default`:
libgomp's own), with wall-clock timers around the backend's parts (its `forward` on decode-only steps and on steps
with a prefill chunk, `decode_attention`, `PageLayout.view` and `write`, the prefill attention, the fp16 window's
reads (`read_window`; `with_window` once it read sinks and window in one pass) and writes), and vLLM's own backend
under the same settings for the same prompts. Each part's median per call and total; the run's wall time. One run
per setting: the machine's noise between runs is a few percent, at times far more.

Two fixed workloads show how much slower the same code runs between the engine's layers than alone: a loop of
2,000 Python additions and 20 numpy sums of an [8, 192] float32 array, timed once before every backend call in
the engine (`probe_python`, `probe_numpy`; with `--probes` only, as they add to the run's time) and 3,000 times back
to back in a process of vLLM's Python of its own (`probes_alone`).

    python experiments/vllm_step_parts.py [--spin default,1000,10000,50000] [--new-tokens 96]
        [--prompt-tokens 2048] [--probes] [--json experiments/results/vllm_step_parts.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

TIMED = r'''
import atexit, json, statistics, sys, time
import kvsqueeze.serving.vllm as sv
import kvsqueeze.paged.layout as pl
from kvsqueeze.serving import vllm_run
T = {}
def timed(name, f):
    def g(*a, **k):
        t0 = time.perf_counter(); r = f(*a, **k); T.setdefault(name, []).append(time.perf_counter() - t0); return r
    return g
sv.decode_attention = timed("decode_attention", sv.decode_attention)
forward = sv.KVSqueezeImpl.forward
def fwd(self, layer, query, key, value, kv_cache, md, *a, **k):
    t0 = time.perf_counter(); r = forward(self, layer, query, key, value, kv_cache, md, *a, **k)
    if md is not None and kv_cache.numel():
        T.setdefault("forward_decode_only" if not md.prefill else "forward_with_prefill", []).append(
            time.perf_counter() - t0)
    return r
sv.KVSqueezeImpl.forward = fwd
import os
if os.environ.get("STEP_PARTS_PROBES"):
    from probes import probe_python, probe_numpy
    def probed(self, *a, _f=sv.KVSqueezeImpl.forward, **k):
        for name, f in (("probe_python", probe_python), ("probe_numpy", probe_numpy)):
            t0 = time.perf_counter(); f(); T.setdefault(name, []).append(time.perf_counter() - t0)
        return _f(self, *a, **k)
    sv.KVSqueezeImpl.forward = probed
for n in ("_read_window", "_with_window", "_write_window", "_prefill"):  # those the code run has
    if hasattr(sv.KVSqueezeImpl, n):
        setattr(sv.KVSqueezeImpl, n, timed(n.strip("_"), getattr(sv.KVSqueezeImpl, n)))
pl.PageLayout.view = timed("view", pl.PageLayout.view)
pl.PageLayout.write = timed("write", pl.PageLayout.write)
def report():
    out = {k: {"calls": len(v), "median_ms": round(1e3 * statistics.median(v), 3), "total_s": round(sum(v), 2)}
           for k, v in T.items()}
    print("PARTS " + json.dumps(out), file=sys.stderr)
atexit.register(report)
sys.argv = ["vllm_run"] + sys.argv[1:]
vllm_run.main()
'''


PROBES = r'''
import numpy

_ROWS = numpy.zeros((8, 192), numpy.float32)


def probe_python():
    s = 0
    for i in range(2000):
        s += i
    return s


def probe_numpy():
    for _ in range(20):
        _ROWS.sum()
'''

ALONE = r'''
import json, statistics, time
from probes import probe_python, probe_numpy
T = {}
for _ in range(3000):
    for name, f in (("probe_python", probe_python), ("probe_numpy", probe_numpy)):
        t0 = time.perf_counter(); f(); T.setdefault(name, []).append(time.perf_counter() - t0)
print(json.dumps({k: round(1e3 * statistics.median(v), 4) for k, v in T.items()}))
'''


def _alone(py: Path, tmp: Path) -> dict:
    """The probes' median ms back to back in a process of vLLM's Python of its own."""
    run = subprocess.run([str(py), "-c", ALONE], env={**os.environ, "PYTHONPATH": str(tmp)}, capture_output=True,
                         text=True, check=True)
    return json.loads(run.stdout)


def _run(py: Path, args: list[str], spin: str, timed: bool, tmp: Path, probes: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSQUEEZE_", "GOMP_SPINCOUNT"))}
    env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    env["PYTHONPATH"] = str(tmp)  # the probes' module
    if probes:
        env["STEP_PARTS_PROBES"] = "1"
    if spin != "default":
        env["GOMP_SPINCOUNT"] = spin
    out = tmp / "out.json"
    # torch is imported before vllm_run.main here, so vllm_run's own setting cannot apply: the env above decides
    cmd = [str(py), "-c", TIMED] if timed else [str(py), "-c", "import torch, sys; from kvsqueeze.serving import "
                                                              "vllm_run; sys.argv = ['vllm_run'] + sys.argv[1:]; "
                                                              "vllm_run.main()"]
    run = subprocess.run([*cmd, *args, "--out", str(out)], env=env, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(run.stderr[-3000:])
    parts = next((json.loads(line[6:]) for line in run.stderr.splitlines() if line.startswith("PARTS ")), None)
    result = json.loads(out.read_text())
    return {"seconds": result["runs"][0]["seconds"], "generated": result["runs"][0]["generated"],
            **({"parts": parts} if parts else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spin", default="default,1000,10000,50000")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--probes", action="store_true", help="time the fixed workloads in the engine too")
    ap.add_argument("--recipe", default="out/recipe")
    ap.add_argument("--method", default="q3.5")
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--json", default=str(ROOT / "experiments" / "results" / "vllm_step_parts.json"))
    args = ap.parse_args()

    from common import machine

    from kvsqueeze.eval.texts import load_text
    from kvsqueeze.integrations.loading import load_model, resolve_model_path
    from kvsqueeze.serving.settings import ServingConfig

    recipe = str(Path(args.recipe).resolve())
    method = ServingConfig(recipe, args.method).spec.name
    model_dir = resolve_model_path("smollm2-135m")
    _, tok = load_model("smollm2-135m", "float32")
    ids = tok(load_text("bbc").evaluation, return_tensors="pt").input_ids[0]
    n = args.prompt_tokens
    prompts = [ids[(10 + i) * n:(11 + i) * n].tolist() for i in range(8)]  # benchmarks/vllm.py's batch
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "prompts.json").write_text(json.dumps(prompts))
        (tmp / "probes.py").write_text(PROBES)
        common = ["--model", model_dir, "--dtype", "bfloat16", "--prompts", str(tmp / "prompts.json"),
                  "--max-tokens", str(args.new_tokens), "--max-model-len", str(n + args.new_tokens + 64),
                  "--kv-bytes", str(1 << 30), "--skip-tokenizer-init"]
        ours = ["--backend", "kvsqueeze", "--recipe", recipe, "--method", method, "--max-num-batched-tokens", "256"]
        for spin in args.spin.split(","):
            row = {"gomp_spincount": spin, "probes_alone": _alone(Path(args.vllm_python), tmp),
                   "kvsqueeze": _run(Path(args.vllm_python), [*common, *ours], spin, True, tmp, args.probes),
                   "vllm": _run(Path(args.vllm_python), [*common, "--backend", "vllm"], spin, False, tmp)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = {"machine": machine(), "model": "smollm2-135m", "method": method, "recipe": args.recipe,
           "requests": 8, "prompt_tokens": n, "new_tokens": args.new_tokens, "prefill_chunk_kvsqueeze": 256,
           "text": "BBC corpus, evaluation part (token ids cut from it)", "rows": rows}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
