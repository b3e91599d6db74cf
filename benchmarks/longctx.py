"""Long context on one model: passkey retrieval and perplexity against context length.

    python benchmarks/longctx.py --recipe out/recipe [--model smollm2-135m] [--text bbc]
        [--methods fp16,nuq4-1%,nuq3-1%,nuq2-1%,kivi2,int3] [--passkey-methods fp16,nuq3-1%,kivi2,int3]
        [--lengths 1024,2048,4096,8192]
        [--trials 10] [--ppl-tokens 8192] [--json benchmarks/results/longctx.json]
        [--plot benchmarks/results/ppl_by_length.png]

Writes {"model", "passkey": [{"method", "length", "accuracy", "trials"}],
"ppl_by_length": [{"method", "seqlen", "ppl", "windows"}]} and a PNG of PPL against length.
Perplexity at every length uses the same number of evaluation tokens (--ppl-tokens),
so 1,024-token windows and 8,192-token windows cover the same text.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from kvsqueeze.eval.longctx import passkey_eval
from kvsqueeze.eval.passkey import format_passkey_table
from kvsqueeze.eval.perplexity import evaluate, format_table
from kvsqueeze.eval.plots import plot_ppl_by_length
from kvsqueeze.eval.texts import load_text, token_windows
from kvsqueeze.integrations.loading import load_model
from kvsqueeze.integrations.preflight import model_windows
from kvsqueeze.methods import parse_methods
from kvsqueeze.recipe import Recipe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--text", default="bbc")
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--methods", default="fp16,nuq4-1%,nuq3-1%,nuq2-1%,kivi2,int3")
    ap.add_argument("--passkey-methods", default=None, help="methods for passkey (default: --methods)")
    ap.add_argument("--lengths", default="1024,2048,4096,8192")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--ppl-tokens", type=int, default=8192)
    ap.add_argument("--skip-passkey", action="store_true")
    ap.add_argument("--resume", action="store_true", help="keep the rows already in --json and measure the rest")
    ap.add_argument("--json", default="benchmarks/results/longctx.json")
    ap.add_argument("--plot", default="benchmarks/results/ppl_by_length.png")
    args = ap.parse_args()

    parse_methods(args.methods, layer_windows=())  # a typo is refused before the model loads
    lengths = [int(x) for x in args.lengths.split(",")]
    model, tok = load_model(args.model)
    recipe = Recipe.load(args.recipe)
    windows = model_windows(model)  # a preset's fp16 window follows the tokens the model's layers hold
    specs = parse_methods(args.methods, layer_windows=windows)
    text = load_text(args.text)
    t0 = time.perf_counter()
    runs: list[dict] = []
    passkey: list[dict] = []
    if args.resume and Path(args.json).exists():  # keep what an earlier, interrupted run measured
        old = json.loads(Path(args.json).read_text())
        t0 -= old.get("seconds", 0.0)  # the reported time covers every run that measured these rows
        passkey = old.get("passkey", [])
        for n in sorted({r["seqlen"] for r in old.get("ppl_by_length", [])}):
            rows = [r for r in old["ppl_by_length"] if r["seqlen"] == n]
            runs.append({"model": args.model, "text": text.name, "seqlen": n, "windows": rows[0]["windows"],
                         "rows": [{"method": r["method"], "ppl": r["ppl"], "avg_bits": r["avg_bits"]} for r in rows]})
    write = lambda: _write(args, text, runs, passkey, t0)  # noqa: E731
    for n in lengths:
        if any(run["seqlen"] == n for run in runs):
            continue
        windows = token_windows(tok, text.evaluation, n, max(1, args.ppl_tokens // n))
        rows = evaluate(model, windows, specs, recipe)
        print(f"{n} tokens x {windows.shape[0]} windows\n{format_table(rows)}")
        runs.append({"model": args.model, "text": text.name, "seqlen": n, "windows": int(windows.shape[0]),
                     "rows": [{"method": r.method, "ppl": r.ppl, "avg_bits": r.avg_bits} for r in rows]})
        write()  # each length is kept as soon as it is measured
    plot_ppl_by_length(runs, args.plot)
    if not args.skip_passkey:
        pk_specs = parse_methods(args.passkey_methods, layer_windows=windows) if args.passkey_methods else specs
        for n in lengths:  # one method and length at a time, written as it completes
            for spec in pk_specs:
                if any(r["method"] == spec.name and r["length"] == n for r in passkey):
                    continue
                results = passkey_eval(model, tok, [spec], [n], args.trials, recipe)
                print(format_passkey_table(results))
                passkey += [{"method": r.method, "length": r.length, "accuracy": r.accuracy, "trials": r.trials}
                            for r in results]
                write()
    print(f"wrote {args.json} and {args.plot}")


def _write(args, text, runs: list[dict], passkey: list[dict], t0: float) -> None:
    payload = {
        "model": args.model,
        "text": f"{text.name} (evaluation part)",
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "seconds": round(time.perf_counter() - t0, 1),
        "passkey": passkey,
        "ppl_by_length": [{"method": row["method"], "seqlen": run["seqlen"], "ppl": round(row["ppl"], 4),
                           "avg_bits": round(row["avg_bits"], 4), "windows": run["windows"]}
                          for run in runs for row in run["rows"]],
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
