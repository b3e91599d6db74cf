"""Bit budgets against plain nuq at the same average bits, on every bundled model, and their decode speed.

    python benchmarks/budget.py [--models smollm2-135m,qwen2.5-coder-0.5b,gemma3-270m] [--windows 3]
        [--plain nuq2-1%,nuq3-1%,nuq4-1%] [--kinds layer,chan,kl:chan,r32:chan] [--decode-context 32768] [--keep-models]
        [--json benchmarks/results/budget.json]

Quality: for each model and each plain method (nuq2-1%, nuq3-1%, nuq4-1%), the budgeted methods `nuq@B`
(a width per layer), `nuq@B:chan` (a width per channel), `nuq@B:r32:chan` (the same with the 32 most recent
tokens in fp16, paid for out of B) and, where the recipe holds the sensitivities
`kvsqueeze budget` measures, `nuq@B:kl:chan` (a width per channel, each layer's keys and values weighed by
their measured loss) with B = the average bits the plain method stores at 2,048 tokens by the budget's
accounting (rounded up to 1e-4, so the budget could choose the plain method in every layer and spends no
more than it), all evaluated on the same spread windows of the BBC evaluation part with the model's own recipe
(`out/models/<model>/recipe`, from `benchmarks/models.py`; `out/recipe` for the default model): PPL, its
change against fp16 with a paired 95% interval, KLD and top-1; and each budgeted method against its plain
method directly (`vs_plain`: the PPL change, its paired 95% interval over the same windows, the ratio of
their mean KL divergences from fp16).

Decode: one decode step of fused attention (the numba backend) over every layer of the default model at
`--decode-context` tokens, each layer's store built with its own quantizers (a budget's layers differ in
bits and outliers), nuq3-1% against nuq@3.5 and nuq@3.5:chan (`--decode-methods`: others, e.g. a budget
with an fp16 window, `nuq@3.5:r32:chan`); median of interleaved rounds. `--models ''` times decode alone:

    python benchmarks/budget.py --models '' --decode-methods nuq3-1%,nuq@3.5:chan,nuq@3.5:r32:chan \
        --json benchmarks/results/decode_window.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from kvsqueeze.eval.perplexity import evaluate, paired_interval
from kvsqueeze.eval.texts import evaluation_windows, load_text
from kvsqueeze.integrations.loading import load_model
from kvsqueeze.methods.budget import sensitivity_key
from kvsqueeze.methods import average_bits, parse_method
from kvsqueeze.recipe import Recipe

sys.path.insert(0, str(Path(__file__).parent))
from common import TAIL_DF, TAIL_Q99, machine  # noqa: E402

PLAIN = ["nuq2-1%", "nuq3-1%", "nuq4-1%"]
KINDS = ("layer", "chan", "kl:chan", "r32:chan")  # budgeted methods: nuq@B, nuq@B:chan, nuq@B:kl:chan, nuq@B:r32:chan


def recipe_path(model: str) -> str:
    return "out/recipe" if model == "smollm2-135m" else f"out/models/{model}/recipe"


def quality_rows(model_name: str, windows: int, seqlen: int, plains: list[str],
                 kinds: tuple[str, ...] = KINDS) -> dict:
    model, tok = load_model(model_name)
    recipe = Recipe.load(recipe_path(model_name))
    fp = recipe.meta["model"]["fingerprint"]
    channels = fp["kv_heads"] * fp["head_dim"]
    specs = [parse_method("fp16")]
    pairs = []
    measured = sensitivity_key(1) in recipe.meta.get("sensitivity", {})  # what nuq@B:kl:chan reads
    for plain in plains:
        spec = parse_method(plain)
        # what the plain method stores in the cache at this length (the registry's count, nominal outliers),
        # rounded up: the budget can afford the plain method's choice in every layer
        bits = average_bits(spec, fp["layers"], channels, fp["head_dim"], seqlen, recipe,
                            windows=fp.get("layer_windows"))
        name = f"nuq@{math.ceil(bits * 1e4) / 1e4:g}"
        # kl:chan where the recipe holds the sensitivities `kvsqueeze budget` measures: the per-channel widths,
        # each layer's keys and values scaled by their measured loss
        budgets = [parse_method(name if kind == "layer" else f"{name}:{kind}") for kind in kinds
                   if measured or kind != "kl:chan"]
        if not budgets:
            raise SystemExit(f"{recipe_path(model_name)} holds no sensitivities for the kl:chan budgets: run "
                             f"`kvsqueeze budget --model {model_name} --recipe {recipe_path(model_name)}` first")
        specs += [spec, *budgets]
        pairs.append((plain, *(b.name for b in budgets)))
    ew = evaluation_windows(tok, load_text("bbc"), seqlen, windows)
    t0 = time.perf_counter()
    rows = evaluate(model, ew.ids, specs, recipe)
    base = rows[0].ppl
    out = [{**r.as_dict(), "change_pct": round(100 * (r.ppl / base - 1), 3)} for r in rows]
    by_name = {r.method: r for r in rows}
    tokens = torch.full((ew.ids.shape[0],), ew.ids.shape[1] - 1)
    for r in out:  # each budgeted method against its plain method, paired over the same windows
        plain = next((p for p, *budgets in pairs if r["method"] in budgets), None)
        if plain is not None:
            mine, theirs = by_name[r["method"]], by_name[plain]
            ci = paired_interval(torch.tensor(mine.window_nll), torch.tensor(theirs.window_nll), tokens)
            r["vs_plain"] = {"method": plain, "change_pct": round(100 * (mine.ppl / theirs.ppl - 1), 3),
                             "ci95": None if ci is None else [round(x, 3) for x in ci],
                             "kld_ratio": round(mine.kld_mean / theirs.kld_mean, 4) if theirs.kld_mean else None}
    for r in out:
        print(f"{model_name:>20} {r['method']:>12} {r['avg_bits']:.3f} {r['ppl']:.3f} {r['change_pct']:+.2f}% "
              f"{r['ci95']} kld {r['kld_mean']:.4f} {r.get('vs_plain', '')}", flush=True)
    return {"model": model_name, "recipe": recipe_path(model_name), "windows": int(ew.ids.shape[0]),
            "window_sources": ew.describe(), "seconds": round(time.perf_counter() - t0, 1), "pairs": pairs,
            "rows": out}


DECODE_METHODS = ("nuq3-1%", "nuq@3.5", "nuq@3.5:chan")


def decode_rows(context: int, rounds: int, methods: tuple[str, ...] = DECODE_METHODS) -> list[dict]:
    """Median ms of one fused decode step over all layers of the default model, per method."""
    from kvsqueeze.cache.positions import PositionLog
    from kvsqueeze.cache.store import KVStore
    from kvsqueeze.kernels import Rope, decode_attention
    from kvsqueeze.methods import build_quantizers

    recipe = Recipe.load(recipe_path("smollm2-135m"))
    fp = recipe.meta["model"]["fingerprint"]
    hq, h, d, layers = fp["heads"], fp["kv_heads"], fp["head_dim"], fp["layers"]
    c = h * d
    rope, scaling = Rope.default(d), d**-0.5
    tdist = torch.distributions.StudentT(TAIL_DF)
    q = torch.randn(1, hq, d)
    caches = {}
    for name in methods:
        spec = parse_method(name)
        stores = []
        for layer in range(layers):
            kq, vq = build_quantizers(spec, recipe, layer, c)
            torch.manual_seed(layer)
            center, half = (kq.hi + kq.lo) / 2, (kq.hi - kq.lo) / 2
            store = KVStore(kq, vq, c, spec.sinks, head_dim=d, positions=PositionLog(), window=spec.window)
            for start in range(0, context, 8192):
                n = min(8192, context - start)
                store.append(center + half * tdist.sample((1, n, c)) / TAIL_Q99, tdist.sample((1, n, c)))
            ref = decode_attention(q, store.view(), rope, scaling, backend="reference")
            got = decode_attention(q, store.view(), rope, scaling, backend="numba")
            if not torch.allclose(got, ref, atol=2e-5, rtol=1e-4):
                raise SystemExit(f"{name} layer {layer}: the numba backend differs from the reference")
            stores.append(store)
        caches[name] = stores
    times = {name: [] for name in caches}
    for r in range(rounds + 1):
        for name in (list(caches) if r % 2 else list(caches)[::-1]):
            t0 = time.perf_counter()
            for store in caches[name]:
                decode_attention(q, store.view(), rope, scaling, backend="numba")
            if r:  # the first round warms up
                times[name].append(time.perf_counter() - t0)
    rows = [{"method": name, "context": context, "layers": layers, "median_ms": round(1e3 * statistics.median(ts), 2),
             "rounds": len(ts)} for name, ts in times.items()]
    for row in rows:
        print(row, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b,gemma3-270m")
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help="the budgeted methods to compare with each plain one: layer (nuq@B), chan, kl:chan")
    ap.add_argument("--plain", default=",".join(PLAIN),
                    help="the plain methods to compare with (each with its budgets)")
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--decode-context", type=int, default=32768, help="0: skip the decode timing")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--decode-methods", default=",".join(DECODE_METHODS), help="methods of the decode timing")
    ap.add_argument("--reuse-decode", action="store_true", help="keep the decode rows of an existing --json")
    ap.add_argument("--keep-models", action="store_true",
                    help="keep the entries of an existing --json for models not in --models (each entry is measured "
                         "on its own recipe and windows)")
    ap.add_argument("--json", default="benchmarks/results/budget.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    plains = [p for p in args.plain.split(",") if p]
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if not kinds or set(kinds) - set(KINDS):
        raise SystemExit(f"--kinds takes some of {', '.join(KINDS)}; got {args.kinds!r}")
    payload = {"machine": machine(), "plain": plains, "models": []}
    if args.reuse_decode and Path(args.json).exists():
        payload["decode"] = json.loads(Path(args.json).read_text())["decode"]
    elif args.decode_context:
        payload["decode"] = decode_rows(args.decode_context, args.rounds,
                                        tuple(m for m in args.decode_methods.split(",") if m))
    names = list(filter(None, args.models.split(",")))
    kept = {}
    if args.keep_models and Path(args.json).exists():
        before = json.loads(Path(args.json).read_text())["models"]
        kept = {m["model"]: m for m in before if m["model"] not in names}
        order = [m["model"] for m in before]
        names = order + [n for n in names if n not in order]  # the file's order, new models last
    for name in names:
        payload["models"].append(kept.get(name) or quality_rows(name, args.windows, args.seqlen, plains, kinds))
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")  # each model as it is done
    Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
