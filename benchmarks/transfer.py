"""Recipes off their calibration text: each model calibrated on one text and on the mix, evaluated on every text.

    python benchmarks/transfer.py [--models smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b] [--calib bbc,mix]
        [--eval bbc,code,facts,plays,es] [--methods fp16,nuq4-1%,nuq3-1%,q4.5,q3.5,q2.5,kivi2]
        [--windows 8] [--seqlen 2048] [--recipes out/transfer] [--json benchmarks/results/transfer.json]

For each model and calibration text, `kvsqueeze calibrate --model M --text T` with its default settings writes a
recipe into `--recipes/M/T` (kept, and reused when it is there: delete it to calibrate again; the JSON names its
content digest, and a recipe with another digest than the one a model's cells were measured with is refused); each
method is then evaluated on `--windows` windows of `--seqlen` tokens spread over the evaluation part of every
`--eval` text, against fp16 on the same windows: perplexity, its change with a paired 95% interval, KL divergence,
top-1, and the average bits the cache holds at `--seqlen` tokens, every table counted (presets resolve for `--seqlen`
and the tokens the model's layers hold). A cell whose presets resolve otherwise now than when it was measured is
measured again; its rows move to `superseded`, with why.
`plays` is in no calibration text, so every recipe meets one kind of text it never saw.

One cell (model, calibration text, evaluation text) at a time, written into the JSON as it finishes; a run that
is stopped resumes at the first missing cell with the same windows, length and methods, and inside that cell
after its last finished window (kept in `--recipes/checkpoints/`, removed once the cell is written).
`summary` gives, per model and calibration text, each method's largest loss over the evaluation texts, its loss
in its own domain, and the ratio of the largest out-of-domain loss to the in-domain one.

`--outliers` measures instead where a recipe meets keys it was not calibrated for: on the first evaluation window
of every text, the share of key and value elements each layer keeps exact under `nuq3-1%` (1% per channel is
what the recipe's key ranges leave out on its calibration text; more says the text's keys reach past the
calibrated ranges), into the JSON's `outliers`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, same_recipe  # noqa: E402

MODELS = "smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b"
CALIB = "bbc,mix"
EVAL = "bbc,code,facts,plays,es"
METHODS = "fp16,nuq4-1%,nuq3-1%,q4.5,q3.5,q2.5,kivi2"


def in_domain(calib: str, evaluated: str) -> bool:
    """Whether the recipe was calibrated on (part of) this kind of text: its own text, or one the mix holds."""
    from kvsqueeze.eval.texts import MIX

    return evaluated == calib or (calib == "mix" and evaluated in MIX)


def recipe_dir(root: Path, model: str, calib: str) -> Path:
    return root / model / calib


def ensure_recipe(root: Path, model: str, calib: str) -> tuple[Path, float | None]:
    """The recipe of `model` calibrated on `calib` with the default settings, calibrated here when missing (its
    wall time returned then)."""
    out = recipe_dir(root, model, calib)
    if (out / "recipe.json").is_file():
        return out, None
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "kvsqueeze.cli", "calibrate", "--model", model, "--text", calib, "--out", str(out)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return out, round(time.perf_counter() - t0, 1)


def cell_key(row: dict) -> tuple:
    return row["model"], row["calib_text"], row["eval_text"]


def load_rows(path: Path, settings: dict) -> list[dict]:
    """Rows of an earlier run with the same windows, length and methods; a file of other settings is refused
    (its cells would be written over by this run's, every model's)."""
    if not path.is_file():
        return []
    old = json.loads(path.read_text())
    if old.get("settings") != settings:
        raise SystemExit(f"{path} was measured with other settings ({old.get('settings')}) than this run's "
                         f"({settings}): run with those, or with --json of a new file")
    return old["rows"]


def summary(rows: list[dict]) -> list[dict]:
    """Per model, calibration text and method: the largest loss over the evaluation texts, the loss in the
    calibration text's own domain (the mean over its texts for the mix) and the ratio of the worst
    out-of-domain loss to it."""
    out = []
    rows = [r for r in rows if "refused" not in r]  # a method a model's cache cannot hold has no numbers
    keys = sorted({(r["model"], r["calib_text"], r["method"]) for r in rows if r["method"] != "fp16"})
    for model, calib, method in keys:
        mine = [r for r in rows if (r["model"], r["calib_text"], r["method"]) == (model, calib, method)]
        inside = [r["delta_pct"] for r in mine if r["in_domain"]]
        outside = [r["delta_pct"] for r in mine if not r["in_domain"]]
        worst = max(mine, key=lambda r: r["delta_pct"])
        own = sum(inside) / len(inside) if inside else None
        out.append({"model": model, "calib_text": calib, "method": method, "texts": len(mine),
                    "worst_delta_pct": worst["delta_pct"], "worst_text": worst["eval_text"],
                    "in_domain_delta_pct": None if own is None else round(own, 3),
                    "worst_out_of_domain_delta_pct": max(outside) if outside else None,
                    "out_over_in": (round(max(outside) / own, 2) if outside and own and own > 0 else None),
                    "avg_bits": round(sum(r["avg_bits"] for r in mine) / len(mine), 4)})
    return out


def evaluate_cell(model, tok, recipe, text, methods: list[str], windows: int, seqlen: int,
                  checkpoint: Path | None = None, layer_windows=()) -> tuple[list, dict]:
    """Every method on the text's evaluation windows; with `checkpoint`, each finished window is kept there and a
    stopped cell resumes after it (`evaluate`). `seconds` is this call's time; `resumed_after` the windows it
    found done."""
    from kvsqueeze.eval.perplexity import checkpoint_windows, evaluate
    from kvsqueeze.eval.texts import evaluation_windows
    from kvsqueeze.methods import preset_for

    ew = evaluation_windows(tok, text, seqlen, windows)
    refused = refusals(model, recipe, methods, seqlen, layer_windows)
    kept = [name for name in methods if name not in refused]
    specs = [preset_for(name, seqlen, layer_windows) for name in kept]
    found = checkpoint_windows(checkpoint) if checkpoint is not None else 0
    t0 = time.perf_counter()
    rows = evaluate(model, ew.ids, specs, recipe, progress=False, checkpoint=checkpoint)
    seconds = time.perf_counter() - t0
    described = ew.describe()
    return [(name, r) for name, r in zip(kept, rows)], {"windows": described["windows"], "of": described["of"],
                                                       "pieces": described["pieces"], "seconds": round(seconds, 1),
                                                       **({"resumed_after": found} if found else {}),
                                                       **({"refused": refused} if refused else {})}


def refusals(model, recipe, methods: list[str], seqlen: int, layer_windows=()) -> dict[str, str]:
    """The methods this model's cache cannot hold as named at `seqlen` tokens (a budget below what its layers
    must store, e.g. an fp16 window on sliding-window layers that hold few tokens), each with the refusal a user
    gets; they are left out of the cell and recorded with it."""
    from kvsqueeze.integrations.simulate import SimulatedQuantization
    from kvsqueeze.methods import MethodError, preset_for

    out = {}
    for name in methods:
        try:
            SimulatedQuantization(model, preset_for(name, seqlen, layer_windows), recipe)
        except MethodError as exc:
            out[name] = str(exc)
    return out


def outlier_shares(model, recipe, ids, method: str = "nuq3-1%") -> dict:
    """The share of key and value elements of each layer kept exact by `method` over one window ids [1, T]."""
    from kvsqueeze.eval.perplexity import window_logits
    from kvsqueeze.integrations.simulate import SimulatedQuantization
    from kvsqueeze.methods import parse_method

    with SimulatedQuantization(model, parse_method(method), recipe) as sim:
        window_logits(model, ids, sim)
        elements = ids.numel() * sim.shape.channels
        k = [float(n) / elements for n in sim.counter.k]
        v = [float(n) / elements for n in sim.counter.v]
    return {"method": method, "key_share": round(sum(k) / len(k), 5), "value_share": round(sum(v) / len(v), 5),
            "key_share_max_layer": round(max(k), 5), "key_share_by_layer": [round(x, 5) for x in k]}


OWN = ("machine", "threads", "settings", "command", "rows", "summary")  # what each run writes anew


def model_windows_of(name: str) -> list[int | None]:
    """Each layer's sliding window of model `name` (None: every token), from its config alone."""
    from transformers import AutoConfig

    from kvsqueeze.integrations.loading import resolve_model_path
    from kvsqueeze.integrations.parts import config_windows

    return config_windows(AutoConfig.from_pretrained(resolve_model_path(name)), name)


def supersede_moved(result: dict, rows: list[dict], windows: dict[str, list], seqlen: int) -> list[dict]:
    """Rows whose presets resolve as measured (`windows`: each model's layer windows); the cells of the others move
    to `result["superseded"]` with why, and are measured again."""
    from kvsqueeze.methods import preset_for

    moved = {}
    for r in rows:
        if r["model"] in windows and "resolved" in r:  # (a row of a version before it named none: kept)
            now = preset_for(r["method"], seqlen, windows[r["model"]]).name
            if now != r["resolved"]:
                moved.setdefault(cell_key(r), set()).add(f"{r['method']} was {r['resolved']}, now {now}")
    if not moved:
        return rows
    old = result.get("superseded")
    blocks = [] if old is None else old if isinstance(old, list) else [old]
    blocks.append({"why": "the presets' fp16 window now follows the tokens a model's layers hold (`preset_window`): "
                          + "; ".join(sorted(set().union(*moved.values()))),
                   "rows": [r for r in rows if cell_key(r) in moved],
                   "cells": {"/".join(k): result["cells"].pop("/".join(k)) for k in moved
                             if "/".join(k) in result["cells"]}})
    result["superseded"] = blocks
    for k, why in moved.items():
        print(f"{'/'.join(k)}: measured again ({'; '.join(sorted(why))})", flush=True)
    return [r for r in rows if cell_key(r) not in moved]


def carried(old: dict) -> dict:
    """What a run keeps of the JSON it resumes: every entry but those it writes anew (`OWN`: its rows come back
    through `load_rows`), so that the recipes, cells, outlier shares and superseded cells of earlier runs, and
    anything a later version adds, are never dropped by a run that does not know them. Cells of a file that
    named one machine for all name that one."""
    kept = {k: v for k, v in old.items() if k not in OWN}
    kept.setdefault("recipes", {})
    for cell in kept.setdefault("cells", {}).values():
        cell.setdefault("machine", old.get("machine"))
    return kept


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=MODELS)
    ap.add_argument("--calib", default=CALIB, help="calibration texts, one recipe each per model")
    ap.add_argument("--eval", default=EVAL, help="evaluation texts")
    ap.add_argument("--methods", default=METHODS)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--recipes", default="out/transfer", help="where the recipes are calibrated and kept")
    ap.add_argument("--json", default="benchmarks/results/transfer.json")
    ap.add_argument("--outliers", action="store_true", help="only the outlier shares of each recipe on each text")
    args = ap.parse_args(argv)

    from kvsqueeze.eval.texts import TEXTS
    from kvsqueeze.methods import parse_method, preset_for

    models = [m for m in args.models.split(",") if m]
    calibs, evals = [c for c in args.calib.split(",") if c], [e for e in args.eval.split(",") if e]
    for name in calibs + evals:
        if name not in TEXTS:
            raise SystemExit(f"unknown text {name!r}; known: {', '.join(TEXTS)}")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if "fp16" not in methods:
        methods.insert(0, "fp16")
    for name in methods:  # a typo is refused before any model is loaded
        preset_for(name, args.seqlen, ())
    if args.windows < 1 or args.seqlen < 2:
        raise SystemExit("--windows must be at least 1 and --seqlen at least 2")

    import torch

    from kvsqueeze.eval.texts import load_text
    from kvsqueeze.integrations.loading import load_model
    from kvsqueeze.recipe import Recipe

    path, root = Path(args.json), Path(args.recipes)
    settings = {"windows": args.windows, "seqlen": args.seqlen, "methods": methods}
    rows = load_rows(path, settings)
    texts = {}
    result = {"machine": machine(), "threads": torch.get_num_threads(), "settings": settings,
              "command": "python benchmarks/transfer.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "recipes": {}, "cells": {}}
    if path.is_file() and rows:
        result.update(carried(json.loads(path.read_text())))
    layer_windows = {m: model_windows_of(m) for m in models}
    rows = supersede_moved(result, rows, layer_windows, args.seqlen)
    done = {cell_key(r) for r in rows}

    def write() -> None:
        result["rows"], result["summary"] = rows, summary(rows)
        result["machine"] = "; ".join(sorted({c["machine"] for c in result["cells"].values() if c.get("machine")})) \
            or machine()  # every machine a cell was measured on (each cell names its own)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # two runs never share one temporary file
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.replace(path)  # never half-written

    if args.outliers:
        return outliers_only(args, models, calibs, evals, result, write, load_text, load_model, Recipe)
    for model_name in models:
        todo = [(c, e) for c in calibs for e in evals if (model_name, c, e) not in done]
        if not todo:
            continue
        model, tok = None, None
        for calib in calibs:
            cells = [e for c, e in todo if c == calib]
            if not cells:
                continue
            rdir, seconds = ensure_recipe(root, model_name, calib)
            recipe = Recipe.load(rdir)
            info = result["recipes"].setdefault(f"{model_name}/{calib}", {})
            digest = recipe.meta.get("tensors_sha256")
            cells_of = [c.get("recipe_sha256") for k, c in result["cells"].items()
                        if k.startswith(f"{model_name}/{calib}/")]  # each cell names its own (older ones: none)
            same_recipe(rdir, digest, [info.get("tensors_sha256"), *cells_of],
                        "the JSON's cells of it were measured with",
                        "Calibrate that one again with the same code, or write to another --json",
                        f"{model_name}/{calib}: ")
            info.update({"path": str(rdir), "settings": recipe.meta.get("settings"), "tensors_sha256": digest,
                         "timings_s": recipe.meta.get("timings_s"), "text": recipe.meta.get("text")})
            if seconds is not None:
                info["calibrate_wall_s"] = seconds
            if model is None:
                model, tok = load_model(model_name)
            for evaluated in cells:
                text = texts.setdefault(evaluated, load_text(evaluated))
                cell_name = f"{model_name}.{calib}.{evaluated}.{args.windows}x{args.seqlen}"
                ckpt = root / "checkpoints" / f"{cell_name}.safetensors"
                pairs, cell = evaluate_cell(model, tok, recipe, text, methods, args.windows, args.seqlen, ckpt,
                                            layer_windows[model_name])
                base = next(r for name, r in pairs if name == "fp16")
                for name, r in pairs:
                    spec = preset_for(name, args.seqlen, layer_windows[model_name])
                    delta = 100 * (r.ppl / base.ppl - 1)
                    rows.append({"model": model_name, "calib_text": calib, "eval_text": evaluated, "method": name,
                                 "resolved": spec.name, "in_domain": in_domain(calib, evaluated),
                                 "avg_bits": round(r.avg_bits, 4), "ppl": round(r.ppl, 4),
                                 "delta_pct": round(delta, 3),
                                 "ci95": None if r.ci95 is None else [round(x, 3) for x in r.ci95],
                                 **({"ci95_over": "windows (Student's t)"} if r.ci95 is not None else {}),
                                 "kld_mean": round(r.kld_mean, 5), "top1": round(r.top1, 4),
                                 "tokens": r.tokens, "windows": cell["windows"],
                                 "window_nll": [round(x, 4) for x in r.window_nll]})
                for name, why in cell.get("refused", {}).items():
                    rows.append({"model": model_name, "calib_text": calib, "eval_text": evaluated, "method": name,
                                 "resolved": preset_for(name, args.seqlen, layer_windows[model_name]).name,
                                 "in_domain": in_domain(calib, evaluated), "refused": why})
                result["cells"][f"{model_name}/{calib}/{evaluated}"] = {**cell, "machine": machine(),
                                                                        "recipe_sha256": digest}
                done.add((model_name, calib, evaluated))
                write()
                ckpt.unlink(missing_ok=True)  # the cell is in the JSON now
                shown = ", ".join(f"{name} {100 * (r.ppl / base.ppl - 1):+.2f}%" for name, r in pairs[1:])
                print(f"{model_name} calibrated on {calib}, {evaluated}: fp16 {base.ppl:.3f}; {shown} "
                      f"({cell['seconds']:.0f} s)", flush=True)
        del model
    write()
    assert all(parse_method(r["resolved"]) for r in rows)
    return 0


def outliers_only(args, models, calibs, evals, result, write, load_text, load_model, Recipe) -> int:
    """`--outliers`: each recipe on the first evaluation window of each text (recipes must exist already)."""
    from kvsqueeze.eval.texts import evaluation_windows

    shares = result.setdefault("outliers", [])
    have = {(o["model"], o["calib_text"], o["eval_text"]) for o in shares}
    for model_name in models:
        model, tok = load_model(model_name)
        for calib in calibs:
            rdir = recipe_dir(Path(args.recipes), model_name, calib)
            if not (rdir / "recipe.json").is_file():
                print(f"no recipe at {rdir}: run without --outliers first", flush=True)
                continue
            recipe = Recipe.load(rdir)
            for evaluated in evals:
                if (model_name, calib, evaluated) in have:
                    continue
                ids = evaluation_windows(tok, load_text(evaluated), args.seqlen, 1).ids
                shares.append({"model": model_name, "calib_text": calib, "eval_text": evaluated,
                               "in_domain": in_domain(calib, evaluated), **outlier_shares(model, recipe, ids)})
                print({k: v for k, v in shares[-1].items() if k != "key_share_by_layer"}, flush=True)
                write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
