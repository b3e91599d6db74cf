"""Which part of a recipe makes the mix calibration cost on Gemma-3-270M: ranges, codebooks or the budget's inputs?

`transfer.json` has Gemma-3-270M calibrated on the mix losing more than calibrated on BBC on every text measured
so far, its own texts included (`q3.5` on BBC +2.28% against +1.07%, on code +3.41% against +2.88%). A recipe
holds three kinds of thing a method reads, each fitted on the calibration text:

- `ranges`: each layer's per-channel key (pre- and post-RoPE) and value ranges, per outlier fraction;
- `codebooks`: each layer's codebooks, per width, outlier fraction and fit (what `nuq3-1%` reads with the ranges);
- `budget`: what a bit budget chooses its widths from, the codebooks' Fisher-weighted objectives
  (`kmeans_objective`) and the per-channel errors (`chanerr`).

Each variant is the BBC recipe with one of them taken from the mix recipe (the two pure recipes beside them), and
each is evaluated with `nuq3-1%` and the 3.5-bit preset on the first `--windows` of the 8 evaluation windows of
2,048 tokens `transfer.py` scores (the same windows, the first ones of its cells), against fp16 on each window.
A part whose swap moves the BBC recipe's loss most of the way to the mix recipe's is where the cost comes from.
The run is resumable: each (window, variant, method) result is kept in `--json` as it comes.

    python experiments/transfer_parts.py [--model gemma3-270m] [--recipes out/transfer] [--text bbc]
        [--windows 4] [--extra NAME=DIR ...] [--only NAME,...] [--json experiments/results/transfer_parts.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import machine  # noqa: E402

from kvsqueeze.eval.perplexity import against_reference, paired_interval, window_logits  # noqa: E402
from kvsqueeze.integrations.simulate import SimulatedQuantization  # noqa: E402
from kvsqueeze.integrations.preflight import model_windows  # noqa: E402
from kvsqueeze.methods import parse_method, preset_for  # noqa: E402
from kvsqueeze.recipe import Recipe  # noqa: E402

PARTS = {
    "ranges": lambda key: ".range." in key,
    "codebooks": lambda key: ".codebook." in key,
    "budget": lambda key: ".chanerr." in key,
}
METHODS = ("nuq3-1%", "q3.5")


def swapped(base: Recipe, donor: Recipe, part: str) -> Recipe:
    """`base` with every tensor of `part` (and, for the budget, the codebooks' objectives) taken from `donor`."""
    pick = PARTS[part]
    tensors = {k: (donor.tensors[k] if pick(k) else v) for k, v in base.tensors.items()}
    meta = dict(base.meta)
    if part == "budget":
        meta["kmeans_objective"] = donor.meta["kmeans_objective"]
    meta.pop("budgets", None)  # stored choices were made from the base's objectives
    return Recipe(meta=meta, tensors=tensors)


def differences(base: Recipe, donor: Recipe) -> dict:
    """How far the donor's parts lie from the base's, layer by layer: the median over channels of the donor's
    range width over the base's (keys before RoPE, values; 1% outliers) and the RMS difference of the 3-bit
    codebooks (1% outliers, levels in the normalized range both recipes map codes to)."""
    layers = int(base.meta["model"]["fingerprint"]["layers"])
    out = {"k_pre_width_ratio": [], "v_width_ratio": [], "k_codebook_rms": [], "v_codebook_rms": []}
    for layer in range(layers):
        for tensor, name in (("k_pre", "k_pre_width_ratio"), ("v", "v_width_ratio")):
            lo, hi = base.channel_range(layer, tensor, 0.01)
            dlo, dhi = donor.channel_range(layer, tensor, 0.01)
            ratio = (dhi - dlo).double() / (hi - lo).double().clamp_min(1e-12)
            out[name].append(round(float(ratio.median()), 4))
        for kv in ("k", "v"):
            a = base.codebook(layer, kv, 3, 0.01, "vector", "fs2").double()
            b = donor.codebook(layer, kv, 3, 0.01, "vector", "fs2").double()
            out[f"{kv}_codebook_rms"].append(round(float((a - b).square().mean().sqrt()), 4))
    return out


def summarize(done: dict, variants: list[str], windows: int) -> list[dict]:
    rows = []
    for variant in variants:
        for method in METHODS:
            have = [done.get(f"{w}/{variant}/{method}") for w in range(windows)]
            if any(h is None for h in have):
                continue
            nll = torch.tensor([h["nll"] for h in have], dtype=torch.float64)
            base = torch.tensor([done[f"{w}/fp16"]["nll"] for w in range(windows)], dtype=torch.float64)
            tok = torch.tensor([h["tokens"] for h in have], dtype=torch.float64)
            delta = 100 * math.expm1(float((nll - base).sum() / tok.sum()))
            ci = paired_interval(nll, base, tok)
            rows.append({"variant": variant, "method": method, "windows": windows, "delta_pct": round(delta, 3),
                         "ci95": None if ci is None else [round(x, 3) for x in ci],
                         "kld_mean": round(sum(h["kld_sum"] for h in have) / float(tok.sum()), 5),
                         "avg_bits": round(sum(h["bits"] for h in have) / sum(h["elements"] for h in have), 4)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--recipes", default="out/transfer")
    ap.add_argument("--text", default="bbc")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--json", default="experiments/results/transfer_parts.json")
    ap.add_argument("--only", default="", help="score only these variants (comma-separated names)")
    ap.add_argument("--extra", action="append", default=[], metavar="NAME=DIR",
                    help="another recipe to score beside the variants (e.g. `balanced_fisher.py`'s)")
    args = ap.parse_args()

    from kvsqueeze.eval.texts import evaluation_windows, load_text
    from kvsqueeze.integrations.loading import load_model

    out = Path(args.json)
    result = json.loads(out.read_text()) if out.is_file() else {}
    recipes = {c: Recipe.load(Path(args.recipes) / args.model / c) for c in ("bbc", "mix")}
    digests = {c: r.meta.get("tensors_sha256") for c, r in recipes.items()}
    if result and (result.get("model"), result.get("text"), result.get("recipes")) != (args.model, args.text,
                                                                                      digests):
        raise SystemExit(f"{out} holds another model, text or recipes: pass another --json")
    variants = {"bbc": recipes["bbc"], "mix": recipes["mix"],
                **{f"bbc+mix.{p}": swapped(recipes["bbc"], recipes["mix"], p) for p in PARTS}}
    for extra in args.extra:
        name, _, path = extra.partition("=")
        if not path or name in variants:
            raise SystemExit(f"--extra {extra!r}: give NAME=DIR with a name not taken ({', '.join(variants)})")
        variants[name] = Recipe.load(path)
        digest = variants[name].meta.get("tensors_sha256")
        held = result.setdefault("extra", {}).get(name)
        if held is not None and held["tensors_sha256"] != digest:
            raise SystemExit(f"{out} scored another recipe as {name!r} ({held['path']}): give this one another name")
        result["extra"][name] = {"path": path, "tensors_sha256": digest, "settings": variants[name].meta["settings"]}
    result["differences"] = differences(recipes["bbc"], recipes["mix"])
    if args.only:
        keep = args.only.split(",")
        unknown = [v for v in keep if v not in variants]
        if unknown:
            raise SystemExit(f"--only {', '.join(unknown)}: no such variant ({', '.join(variants)})")
        variants = {v: variants[v] for v in keep}
    model, tok = load_model(args.model)
    windows = model_windows(model)  # a preset's fp16 window follows the tokens the model's layers hold
    ids = evaluation_windows(tok, load_text(args.text), 2048, 8).ids[:args.windows]
    done = result.setdefault("done", {})
    result.update({"model": args.model, "text": args.text, "recipes": digests, "machine": machine(),
                   "windows": "the first N of the 8 evaluation windows of 2,048 tokens transfer.py scores",
                   "methods": {m: preset_for(m, 2048, windows).name for m in METHODS}})

    def write() -> None:
        result["rows"] = summarize(done, list(variants), args.windows)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.replace(out)

    fp16 = parse_method("fp16")
    wanted = [f"{variant}/{method}" for variant in variants for method in METHODS
              if not (variant == "bbc+mix.budget" and method == "nuq3-1%")]  # the budget's inputs: no fixed width
    for w in range(args.windows):
        if all(f"{w}/{v}" in done for v in wanted):
            continue
        window = ids[w].view(1, -1)
        with SimulatedQuantization(model, fp16, recipes["bbc"]) as sim:
            ref = window_logits(model, window, sim)[0]
        target = window[0, 1:]
        ref_top = ref.argmax(-1)
        done[f"{w}/fp16"] = {"nll": float(-ref.gather(1, target[:, None]).sum()), "tokens": int(target.numel())}
        for variant, recipe in variants.items():
            for method in METHODS:
                key = f"{w}/{variant}/{method}"
                if key in done or f"{variant}/{method}" not in wanted:
                    continue
                t0 = time.perf_counter()
                with SimulatedQuantization(model, preset_for(method, 2048, windows), recipe) as sim:
                    logp = window_logits(model, window, sim)[0]
                    bits = 8 * sum(sim.storage(window.numel()).values())
                    elements = sim.elements(window.numel())
                nll, kld, top1 = against_reference(ref, ref_top, logp, target)  # in pieces of its own: no 2 GB copies
                del logp
                done[key] = {"nll": nll, "tokens": int(target.numel()), "kld_sum": float(kld.sum()),
                             "top1": top1, "bits": bits, "elements": elements,
                             "seconds": round(time.perf_counter() - t0, 1)}
                change = 100 * math.expm1((nll - done[f"{w}/fp16"]["nll"]) / target.numel())
                print(f"window {w} {variant} {method}: {change:+.2f}% KL {float(kld.mean()):.4f}", flush=True)
                write()
    write()  # the rows of the variants asked for, also when every window was done before
    for row in result["rows"]:
        print(row, flush=True)


if __name__ == "__main__":
    main()
