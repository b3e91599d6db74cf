"""The KVQuant ablation ladder and bit-width table on one model and text (simulated quantization).

    python benchmarks/ladder.py --recipe out/recipe --recipe-sink0 out/recipe-sink0 [--model smollm2-135m]
        [--text bbc] [--seqlen 2048] [--windows 8] [--json benchmarks/results/ladder.json]

A fair ladder: every rung that keeps the first token exact (`sink1`) reads a recipe calibrated without it
(`--recipe`, `kvsqueeze calibrate --sinks 1`, the default), every rung that quantizes it (`sink0`) a recipe
calibrated with it (`--recipe-sink0`, `--sinks 0`), so no rung quantizes a token its statistics never saw;
the per-channel int / nf baselines and the unweighted / Fisher / Fisher * s^2 steps keep the same sink as
nuq, so each step changes one thing. Windows are spread over the whole evaluation part.

Writes {"model", "text", "seqlen", "windows", "window_sources", "recipes", "rows": [{"method", "avg_bits",
"ppl", "ci95", "kld_mean", "kld_p99", "top1", "step", "recipe_sinks"}]} and prints a Markdown table. The JSON
is written after every `--group` methods, with the methods not yet measured under "missing": a run cut short
goes on from there with `--reuse`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

from kvsqueeze.eval.perplexity import evaluate
from kvsqueeze.eval.texts import evaluation_windows, load_text
from kvsqueeze.integrations.loading import load_model
from kvsqueeze.methods import needs_recipe, parse_method
from kvsqueeze.recipe import Recipe

sys.path.insert(0, str(Path(__file__).parent))
from common import machine  # noqa: E402

LADDER = [
    ("int3", "int3: keys per-token post-RoPE (baseline)"),
    ("int3:kchan", "+ keys per-channel (post-RoPE)"),
    ("int3:kchan:pre", "+ keys pre-RoPE"),
    ("int3:kchan:pre:sink1", "+ 1 fp16 attention sink"),
    ("nuq3:unw", "nuq3, unweighted k-means"),
    ("nuq3:fisher", "nuq3, Fisher-weighted"),
    ("nuq3", "nuq3, Fisher * s^2 (KVQuant)"),
    ("nuq3-0.1%:pm", "+ 0.1% outliers, per-matrix"),
    ("nuq3-1%:pm", "+ 1% outliers, per-matrix"),
    ("nuq3-0.1%", "+ 0.1% outliers, per-vector"),
    ("nuq3-1%", "+ 1% outliers, per-vector"),
    ("nuq3:sink0", "nuq3 without the sink (its own recipe)"),
    ("nuq3-1%:sink0", "nuq3-1% without the sink (its own recipe)"),
]
BITS = [
    (f"{fam}{b}{suffix}", f"{b}-bit")  # described from the name by benchmarks/report.py
    for b in (4, 3, 2)
    for fam, suffix in (("int", ""), ("nf", ""), ("int", ":kchan:pre:sink1"), ("nf", ":kchan:pre:sink1"),
                        ("nuq", ""), ("nuq", "-1%"))
]
BUDGETS = [  # quality per bit: each layer's K / V bits and outliers chosen from the recipe (kvsqueeze.methods.budget)
    ("nuq@2.5", "bit budget 2.5: per-layer K/V bits and outliers from the Fisher objectives"),
    ("nuq@2.6", "bit budget 2.6"),
    ("nuq@3", "bit budget 3.0"),
    ("nuq@3.5", "bit budget 3.5"),
    ("nuq@4.5", "bit budget 4.5"),
    ("nuq3-1%:sink16", "nuq3-1% with 16 fp16 sinks (more sinks, ~0.06 bits)"),
    ("nuq@2.6:kl", "bit budget 2.6 from measured sensitivities (`kvsqueeze budget`)"),
    ("nuq@3.5:kl", "bit budget 3.5 from measured sensitivities"),
    ("nuq@4.5:kl", "bit budget 4.5 from measured sensitivities"),
    ("nuq@2.5:chan", "bit budget 2.5, a width (1-6 bits) per channel from the per-channel Fisher errors"),
    ("nuq@2.6:chan", "bit budget 2.6, a width per channel"),
    ("nuq@3:chan", "bit budget 3.0, a width per channel"),
    ("nuq@3.45:chan", "bit budget 3.45, a width per channel"),
    ("nuq@3.49:chan", "bit budget 3.49, a width per channel (evaluation text's key outliers stay under 3.5)"),
    ("nuq@3.5:chan", "bit budget 3.5, a width per channel"),
    ("nuq@4:chan", "bit budget 4.0, a width per channel"),
    ("nuq@4.5:chan", "bit budget 4.5, a width per channel"),
    ("nuq@4.58:chan", "bit budget 4.58, a width per channel (evaluation text's key outliers stay under 4.6)"),
    ("nuq@4.6:chan", "bit budget 4.6, a width per channel"),
    ("nuq@2.5:kl:chan", "bit budget 2.5, a width per channel, each layer's K / V errors scaled by its measured "
                        "sensitivity"),
    ("nuq@2.6:kl:chan", "bit budget 2.6, a width per channel, measured scales"),
    ("nuq@3.49:kl:chan", "bit budget 3.49, a width per channel, measured scales"),
    ("nuq@3.5:kl:chan", "bit budget 3.5, a width per channel, measured scales"),
    ("nuq@4.5:kl:chan", "bit budget 4.5, a width per channel, measured scales"),
    ("nuq@4.58:kl:chan", "bit budget 4.58, a width per channel, measured scales"),
    ("nuq@2.5:r32:chan", "bit budget 2.5, a width per channel, the 32 most recent tokens in fp16 (counted)"),
    ("nuq@3.49:r32:chan", "bit budget 3.49, a width per channel, the 32 most recent tokens in fp16"),
    ("nuq@4.58:r32:chan", "bit budget 4.58, a width per channel, the 32 most recent tokens in fp16"),
    ("nuq@2.6:r32:chan", "bit budget 2.6, a width per channel, the 32 most recent tokens in fp16"),
    ("nuq@3.5:r32:chan", "bit budget 3.5, a width per channel, the 32 most recent tokens in fp16"),
]
PAGED = [  # a fixed count of exact key elements per token, as the paged cache of a serving engine stores them
    ("nuq3-1%:kslots4", "nuq3-1%, 4 exact key elements per token (outliers first)"),
    ("nuq3-1%:kslots6", "nuq3-1%, 6 exact key elements per token (the vLLM backend's default for plain nuq3-1%)"),
    ("nuq3-1%:kslots8", "nuq3-1%, 8 exact key elements per token"),
    ("nuq2-1%:kslots6", "nuq2-1%, 6 exact key elements per token"),
    ("nuq4-1%:kslots6", "nuq4-1%, 6 exact key elements per token"),
]
OTHERS = [
    ("kivi2", "KIVI-2 (group 32, 128 fp16 recent)"),
    ("kivi4", "KIVI-4"),
    ("group3", "grouped uniform per-token, group 128 (ATOM/FlexGen)"),
    ("nuq-k3v2-1%", "mixed: keys 3-bit, values 2-bit, 1% outliers"),
]


def recipe_digest(recipe: Recipe) -> dict:
    """What a row read from its recipe, hashed: every tensor ("digest"; settings alone do not tell two calibrations
    apart) and the measured sensitivities ("sensitivity", read by `:kl` budgets only)."""
    h = hashlib.sha256()
    for key in sorted(recipe.tensors):
        h.update(key.encode())
        h.update(recipe.tensors[key].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    measured = hashlib.sha256(json.dumps(recipe.meta.get("sensitivity"), sort_keys=True).encode())
    return {"digest": h.hexdigest()[:16], "sensitivity": measured.hexdigest()[:16]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--text", default="bbc")
    ap.add_argument("--recipe", required=True, help="calibrated with --sinks 1 (the default)")
    ap.add_argument("--recipe-sink0", help="calibrated with --sinks 0, for the sink0 rungs (may be left out with "
                    "--reuse when the existing --json holds every sink0 row)")
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--json", default="benchmarks/results/ladder.json")
    ap.add_argument("--group", type=int, default=6, help="methods measured between two writes of --json")
    ap.add_argument("--reuse", action="store_true",
                    help="keep the rows of an existing --json measured on the same windows with the same recipes and "
                         "measure only the methods it lacks")
    args = ap.parse_args()

    torch.manual_seed(0)
    model, tok = load_model(args.model)
    by_sinks = {}
    for path in filter(None, (args.recipe, args.recipe_sink0)):
        r = Recipe.load(path)
        by_sinks[int(r.meta["settings"]["sinks"])] = r
    if set(by_sinks) != ({0, 1} if args.recipe_sink0 else {1}):
        raise SystemExit(f"--recipe and --recipe-sink0 must be calibrated with --sinks 1 and 0, got {sorted(by_sinks)}")
    ew = evaluation_windows(tok, load_text(args.text), args.seqlen, args.windows)
    steps: dict[str, str] = {"fp16": "fp16 baseline"}
    for name, label in LADDER + BITS + OTHERS + BUDGETS + PAGED:
        steps.setdefault(parse_method(name).name, label)
    specs = [parse_method(n) for n in steps]
    settings = {str(k): {**v.meta.get("settings"), **recipe_digest(v)} for k, v in sorted(by_sinks.items())}
    kept: dict[str, dict] = {}
    if args.reuse and Path(args.json).exists():
        old = json.loads(Path(args.json).read_text())
        if not args.recipe_sink0:  # the sink0 rows are all kept (checked below): their recipe as recorded
            settings = {"0": old["recipes"].get("0"), **settings}

        def calibrated(recipes: dict) -> dict:  # what every row read: the recipes without their sensitivities
            return {k: {**v, "sensitivity": None} if v else v for k, v in recipes.items()}

        if (old["seqlen"], old["window_sources"], calibrated(old["recipes"]), old["model"]) != (
                args.seqlen, ew.describe(), calibrated(settings), args.model):
            raise SystemExit(f"--reuse: {args.json} was measured on other windows, model or recipes; run without it")
        remeasured = {k for k, v in settings.items() if v and old["recipes"].get(k) != v}  # sensitivities changed
        kept = {r["method"]: r for r in old["rows"] if r["method"] in steps and r["method"] != "fp16"
                and not (parse_method(r["method"]).budget_proxy == "kl" and str(min(parse_method(r["method"]).sinks, 1))
                         in remeasured)}
    missing = [s.name for s in specs if needs_recipe(s) and min(s.sinks, 1) not in by_sinks and s.name not in kept]
    if missing:
        raise SystemExit(f"{', '.join(missing)} read a recipe calibrated with --sinks 0: pass --recipe-sink0")
    recipes = {s.name: by_sinks[min(s.sinks, 1)] for s in specs if needs_recipe(s) and s.name not in kept}
    t0 = time.perf_counter()
    todo = [s for s in specs if s.name not in kept]
    measured: dict[str, dict] = {}

    def write() -> list[dict]:
        """The rows so far, in ladder order, written at once: a run cut short is resumed with --reuse."""
        rows = [measured.get(name) or kept.get(name) for name in steps]
        payload = {
            "model": args.model, "text": f"{args.text} (evaluation part)", "seqlen": args.seqlen,
            "windows": int(ew.ids.shape[0]), "window_sources": ew.describe(), "machine": machine(),
            "recipes": settings, "seconds": round(time.perf_counter() - t0, 1),
            **({"reused_rows": sorted(kept)} if kept else {}),
            **({"missing": [n for n, r in zip(steps, rows) if r is None]} if None in rows else {}),
            "rows": [r for r in rows if r is not None],
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
        return payload["rows"]

    # methods in groups (fp16 with the first), each group's rows written as soon as it is measured
    for i in range(0, len(todo), args.group):
        group = todo[i:i + args.group]
        if "fp16" not in {s.name for s in group} and "fp16" not in measured:
            group = [parse_method("fp16"), *group]
        for r in evaluate(model, ew.ids, group, by_sinks[1], recipes=recipes):
            measured[r.method] = {**r.as_dict(), "step": steps[r.method], "recipe_sinks": (
                int(recipes[r.method].meta["settings"]["sinks"]) if r.method in recipes else None)}
        write()
    table = write()
    base = table[0]["ppl"]
    print("| method | what | avg bits | PPL | vs fp16 | 95% CI | KLD | top-1 |\n|---|---|---|---|---|---|---|---|")
    for r in table:
        ci = f"[{r['ci95'][0]:+.2f}, {r['ci95'][1]:+.2f}]" if r["ci95"] else ""
        print(f"| `{r['method']}` | {r['step']} | {r['avg_bits']:.2f} | {r['ppl']:.3f} | "
              f"{(r['ppl'] / base - 1) * 100:+.2f}% | {ci} | {r['kld_mean']:.4f} | {100 * r['top1']:.1f}% |")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
