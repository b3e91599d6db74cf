"""The `kvsqueeze` command: calibrate, eval, budget, inspect, memory, passkey, ruler, generate.

Every option takes its default from the config dataclasses in `config.py`,
which are also the defaults of the Python functions that do the work, so the
CLI and the Python API cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

from .config import (
    DEFAULT_DEVICE,
    DEFAULT_DTYPE,
    DEFAULT_MODEL,
    DTYPES,
    DEFAULT_TEXT,
    CalibrationConfig,
    EvalConfig,
    GenerateConfig,
    InspectConfig,
    MemoryConfig,
    PasskeyConfig,
    RulerConfig,
)

_CAL, _EVAL, _PASSKEY = CalibrationConfig(), EvalConfig(), PasskeyConfig()
_GEN, _MEM, _INSPECT, _RULER = GenerateConfig(), MemoryConfig(), InspectConfig(), RulerConfig()


TEXT_NAMES = "bbc, code, facts, plays, es, mix"  # kvsqueeze.eval.texts.TEXTS (not imported: it loads torch)
TEXT_HELP = "a bundled text (" + TEXT_NAMES + "; its {part}) or a text file"

MAX_TOKENS = 1 << 21  # lengths beyond any model's context are refused when parsed, the rest against the model
MAX_SINKS = 1024


def _bounded(lo: int, hi: int | None = None):
    """An argparse type: an integer in [lo, hi], refused at parse time otherwise."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"{v} is out of range: give an integer from {lo} to "
                                             f"{'any larger' if hi is None else hi}")
        return v
    return parse


def _percentages(text: str, what: str) -> tuple[float, ...]:
    """Comma-separated outlier percentages, each in [0, 50)."""
    try:
        vals = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated percentages, e.g. 0.1,1; got {text!r}") from None
    bad = [v for v in vals if not 0 <= v < 50]
    if bad or not vals:
        raise ValueError(f"{what} {text!r}: each outlier percentage must lie in [0, 50), e.g. 1 for 1%")
    return tuple(v / 100 for v in vals)


def _check_context(model, lengths, what: str) -> None:
    """Refuse lengths beyond the model's context before any work."""
    from .shape import context_length

    limit = context_length(model.config)
    too_long = [n for n in lengths if limit and n > limit]
    if too_long:
        raise ValueError(f"{what} {','.join(map(str, too_long))} exceed(s) the model's {limit}-token context: give "
                         f"lengths up to {limit}")


def _int_list(text: str, what: str) -> list[int]:
    try:
        vals = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}")
    if not vals:
        raise ValueError(f"{what} is empty")
    return vals


def _recipe_for(specs, path: str | None):
    """Load the recipe, or fail before any work when a method needs one and none was given."""
    from .methods import needs_recipe
    from .recipe import Recipe, RecipeError

    need = [s.name for s in specs if needs_recipe(s)]
    if need and not path:
        raise RecipeError(
            f"methods {', '.join(need)} use offline calibration statistics: pass --recipe DIR "
            "(create one with `kvsqueeze calibrate --out DIR`)"
        )
    return Recipe.load(path) if path else None


def _per_length(methods: str, lengths: list[int], model=None) -> dict:
    """Each length's methods ({length: [MethodSpec]}), a preset chosen for it (at least 2,048 tokens) and, given
    the model, for the tokens its layers hold (before it loads: for layers that hold every token, which checks
    the names and which recipe they need)."""
    from .methods import parse_methods

    windows = ()
    if model is not None:
        from .integrations.preflight import model_windows

        windows = model_windows(model)
    return {n: parse_methods(methods, reaching=n, layer_windows=windows) for n in lengths}


def _distinct(per_length: dict) -> list:
    """The methods of every length ({length: [MethodSpec]}), each once, in order of first appearance."""
    return list({s.name: s for specs in per_length.values() for s in specs}.values())


def _check_methods(model, specs, recipe) -> None:
    """Build every method's quantizers once up front so a bad combination fails before minutes of work."""
    from .integrations.preflight import check_methods

    check_methods(model, specs, recipe)

def _check_outputs(**paths: str | None) -> None:
    """Refuse, before any work, an output file (`--json`, `--plot`) that could not be written at the end: a
    directory, a path under a file, or one in a directory this process cannot write to."""
    for flag, path in paths.items():
        if not path:
            continue
        p = Path(path)
        where = next((a for a in (p.parent, *p.parent.parents) if a.exists()), Path("."))
        problem = ("is a directory" if p.is_dir() else f"lies under {where}, which is a file" if not where.is_dir()
                   else f"is in {where}, which this process cannot write to" if not os.access(where, os.W_OK)
                   else None)
        if problem:
            raise ValueError(f"--{flag.replace('_', '-')} {path} {problem}: give a file path that can be written")


def _write_json(path: str | None, payload: dict) -> None:
    """The payload written whole: to a temporary name beside the file, then renamed over it."""
    if path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(payload, indent=2) + "\n")
        os.replace(tmp, p)
        print(f"wrote {path}")


def cmd_calibrate(args) -> None:
    bits = tuple(_int_list(args.bits, "--bits"))
    for b in bits:
        if b not in (2, 3, 4):
            raise ValueError(f"--bits {b} is not supported; use 2, 3 and/or 4")
    if args.seqlen - args.sinks < 2:
        raise ValueError(f"--seqlen {args.seqlen} with --sinks {args.sinks} leaves {max(0, args.seqlen - args.sinks)} "
                         "token(s) of each window for the statistics, and a window's last token carries no gradient "
                         f"(nothing follows it): give --seqlen of at least {args.sinks + 2}")
    fractions = _percentages(args.outliers, "--outliers")
    cfg = CalibrationConfig(samples=args.samples, seqlen=args.seqlen, bits=bits,
                            fractions=tuple(sorted({0.0, *fractions})), sinks=args.sinks, ablation=args.ablation)
    tokens = args.samples * max(0, args.seqlen - args.sinks)  # the values each channel's range is fitted on
    few = [f for f in fractions if f and int(round(f / 2 * tokens)) == 0]  # as `numerics.outliers` counts them
    if few:
        f = min(few)
        raise ValueError(f"--outliers {100 * f:g}: {tokens} calibration tokens (--samples {args.samples} x --seqlen "
                         f"{args.seqlen}, less {args.sinks} sink(s) each) leave no value outside a {100 * f:g}% range, "
                         f"so it would equal the range without outliers; give more than {math.ceil(1 / f)} tokens "
                         f"(--samples, --seqlen), or leave {100 * f:g} out of --outliers")
    _check_kl_options(args, bits, fractions)
    budgets = _budgets(args.avg_bits)
    from .recipe import RUN_LOCK_FILE, check_directory, writing

    out = check_directory(args.out)  # before any work: a file, or a directory that cannot be written, is refused
    with writing(out, lock=RUN_LOCK_FILE, wait=False):  # and so is a second calibration into it at the same time
        _calibrate(args, cfg, budgets)


def _check_kl_options(args, bits: tuple[int, ...], fractions: tuple[float, ...]) -> None:
    """`calibrate`'s --kl-* options, before any work: each needs --kl, and measures widths and outlier
    fractions this calibration fits (a sensitivity is measured on the recipe's own choices)."""
    given = [f"--kl-{name}" for name in ("windows", "seqlen", "bits", "outliers")
             if getattr(args, f"kl_{name}") is not None]
    if given and not args.kl:
        raise ValueError(f"{', '.join(given)} set(s) what --kl measures: add --kl, or leave {given[0]} out")
    if args.kl_bits:
        extra = [b for b in _int_list(args.kl_bits, "--kl-bits") if b not in bits]
        if extra:
            raise ValueError(f"--kl-bits {extra[0]}: this calibration fits --bits {','.join(map(str, bits))} only; "
                             "measure widths among them, or add the width to --bits")
    if args.kl_outliers:
        extra = [f for f in _percentages(args.kl_outliers, "--kl-outliers") if f and f not in fractions]
        if extra:
            raise ValueError(f"--kl-outliers {100 * extra[0]:g}: this calibration fits --outliers "
                             f"{','.join(f'{100 * f:g}' for f in fractions if f) or 'none'} only; measure fractions "
                             "among them, or add it to --outliers")


def _calibrate(args, cfg: CalibrationConfig, budgets: list[float]) -> None:
    from .calibrate.collect import collect
    from .calibrate.fit import fit_recipe
    from .eval.texts import calibration_windows, load_text
    from .integrations.loading import load_model

    t0 = time.perf_counter()
    text = load_text(args.text, args.encoding)
    model, tok = load_model(args.model, args.dtype, args.device)
    _check_context(model, [cfg.seqlen], "--seqlen")
    if args.kl:
        _check_context(model, [_kl_seqlen(args)], "--kl-seqlen")
    t_load = time.perf_counter() - t0
    samples = calibration_windows(tok, text, cfg.samples, cfg.seqlen)
    kl_windows = calibration_windows(tok, text, _kl_windows(args), _kl_seqlen(args)) if args.kl else None
    print(f"[1/3] loaded {args.model} and {text.name} in {t_load:.1f}s; {cfg.samples} x {cfg.seqlen} tokens")
    acts = collect(model, samples, sinks=cfg.sinks)
    print(f"[2/3] activations and Fisher information in {acts.seconds:.1f}s (calibration loss {acts.loss:.3f})")
    recipe = fit_recipe(model, acts, cfg, args.model, text.name)
    print(f"[3/3] ranges, thresholds and codebooks in {recipe.meta['timings_s']['fit']:.1f}s")
    recipe.meta["calibration_pieces"] = sorted(text.calibration_pieces)  # lets eval tell held-out text apart
    recipe.meta["timings_s"]["load"] = round(t_load, 2)
    try:
        if args.kl:
            t1 = time.perf_counter()
            table = _measure_sensitivities(model, tok, recipe, text, args, windows=kl_windows)
            recipe.meta["timings_s"]["sensitivity"] = round(time.perf_counter() - t1, 2)
            print(f"[+] sensitivities of {len(table['kl'])} choices in {recipe.meta['timings_s']['sensitivity']:.1f}s")
        _store_budgets(recipe, budgets, args.kl_sinks, ("fisher", "kl") if args.kl else ("fisher",))
    except (ValueError, FloatingPointError) as exc:  # MethodError and RecipeError are ValueErrors
        # the fit is minutes of work and whole without what follows it: keep it, and say what is missing
        recipe.meta.pop("sensitivity", None)
        recipe.meta.pop("budgets", None)
        recipe.meta["timings_s"]["total"] = round(time.perf_counter() - t0, 2)
        out = recipe.save(args.out)
        raise ValueError(f"{exc} (the calibrated recipe is written to {out} without "
                        f"{'its sensitivities or ' if args.kl else ''}stored budgets: `kvsqueeze budget --recipe "
                        f"{out}` measures the sensitivities, and nuq@AVG methods choose their widths when used)"
                         ) from exc
    recipe.meta["timings_s"]["total"] = round(time.perf_counter() - t0, 2)
    out = recipe.save(args.out)
    objs = recipe.meta["kmeans_objective"]
    for bits in cfg.bits:
        for kv in ("k", "v"):
            sel = [o for k, o in objs.items() if f".codebook.{kv}.b{bits}.p0.vector" in k]
            if sel:
                nuq = sum(o["nuq"] for o in sel)
                print(f"  {kv.upper()} {bits}-bit weighted k-means objective (all layers): nuq {nuq:.4g}, "
                      f"uniform {sum(o['uniform'] for o in sel) / nuq:.2f}x, nf {sum(o['nf'] for o in sel) / nuq:.2f}x")
    print(f"recipe written to {out} in {recipe.meta['timings_s']['total']:.1f}s")


KL_WINDOWS, KL_SEQLEN = 1, 512  # what a sensitivity measurement reads by default: windows of tokens


def _kl_windows(args) -> int:
    return KL_WINDOWS if args.kl_windows is None else args.kl_windows


def _kl_seqlen(args) -> int:
    return KL_SEQLEN if args.kl_seqlen is None else args.kl_seqlen


def _measure_sensitivities(model, tok, recipe, text, args, windows=None) -> dict:
    """`kvsqueeze budget` / `calibrate --kl`: each layer's K and V measured at the chosen widths and outlier
    fractions (default: the recipe's middle width, with none and its largest fraction) on calibration windows;
    the table goes into the recipe."""
    from .methods.budget import _options, drop_kl_budgets, sensitivity_key
    from .calibrate.sensitivity import measure_sensitivity
    from .eval.texts import calibration_windows

    calibrated = _options(recipe)
    widths = sorted({c.bits for c in calibrated})
    flag = "--kl-bits" if args.command == "calibrate" else "--bits"
    bits = tuple(_int_list(args.kl_bits, flag)) if args.kl_bits else (widths[len(widths) // 2],)
    if args.kl_outliers:
        fractions = tuple(sorted({0.0, *_percentages(args.kl_outliers, flag.replace("bits", "outliers"))}))
    else:
        fractions = tuple(sorted({0.0, max(c.fraction for c in calibrated)}))
    if windows is None:
        windows = calibration_windows(tok, text, _kl_windows(args), _kl_seqlen(args))
    print(f"measuring each layer's K and V at {', '.join(map(str, bits))} bits with outliers "
          f"{', '.join(f'{100 * f:g}%' for f in fractions)} on {_kl_windows(args)} x {_kl_seqlen(args)} tokens of "
          f"{text.name} (calibration part)")
    t0 = time.perf_counter()
    table = measure_sensitivity(model, recipe, windows, sinks=args.kl_sinks, fractions=fractions, bits=bits)
    table["seconds"] = round(time.perf_counter() - t0, 1)
    table["text"] = text.name  # what the KL was measured on
    recipe.meta.setdefault("sensitivity", {})[sensitivity_key(args.kl_sinks)] = table
    dropped = drop_kl_budgets(recipe, args.kl_sinks)  # chosen from the table this one replaces
    if dropped:
        print(f"  dropped the stored choices of {', '.join('nuq@' + k for k in dropped)} (made from the table this "
              "one replaces; chosen again from it when used, or stored with --avg-bits)")
    return table


def _store_budgets(recipe, budgets: list[float], sinks: int, proxies: tuple[str, ...]) -> None:
    """Each budget's choice, per layer and per channel, for each proxy, stored in the recipe and summarised."""
    from .methods.budget import KEY_OUTLIER_HEADROOM, allocate, allocate_channels, budget_key

    for avg in budgets:
        for proxy in proxies:
            tag = ":kl" if proxy == "kl" else ""
            alloc = allocate(recipe, avg, sinks, proxy=proxy)
            recipe.meta.setdefault("budgets", {})[budget_key(avg, sinks, proxy)] = alloc.as_dict()
            mix = ", ".join(f"{kv} {n}x{label}" for kv, chosen in (("K", alloc.keys), ("V", alloc.values))
                            for label, n in sorted(_count(c.label() for c in chosen).items()))
            print(f"  nuq@{avg:g}{tag}: {alloc.bits:.3f} bits per element at {alloc.tokens} tokens (key outliers "
                  f"charged at {KEY_OUTLIER_HEADROOM:g}x their nominal count); {mix}")
            alloc = allocate_channels(recipe, avg, sinks, proxy=proxy)
            recipe.meta["budgets"][budget_key(avg, sinks, proxy, unit="channel")] = alloc.as_dict()
            print(f"  nuq@{avg:g}{tag}:chan: {alloc.bits:.3f} bits per element at {alloc.tokens} tokens; mean key "
                  f"width {sum(c.mean_bits for c in alloc.keys) / len(alloc.keys):.2f}, value width "
                  f"{sum(c.mean_bits for c in alloc.values) / len(alloc.values):.2f}")


def _budgets(text: str | None) -> list[float]:
    if not text:
        return []
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--avg-bits takes average bits per element, e.g. 3.5 or 2.6,3.5; got {text!r}") from None
    bad = [v for v in values if not 2.0 <= v <= 16.0]
    if bad:
        raise ValueError(f"--avg-bits {bad[0]:g}: give an average between 2 and 16 bits per element")
    return values


def _count(items) -> dict:
    out: dict = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


def cmd_eval(args) -> None:
    from .eval.perplexity import evaluate, format_table
    from .eval.texts import evaluation_windows, load_text
    from .integrations.loading import load_model
    from .methods import needs_recipe

    _check_outputs(json=args.json, plot=args.plot)
    seqlens = _int_list(args.seqlen, "--seqlen")
    recipe = _recipe_for(_distinct(_per_length(args.methods, seqlens)), args.recipe)
    text = load_text(args.text, args.encoding)
    model, tok = load_model(args.model, args.dtype, args.device)
    _check_context(model, seqlens, "--seqlen")
    per_length = _per_length(args.methods, seqlens, model)  # a preset chosen for each length and this model
    specs = per_length[seqlens[0]]
    every = _distinct(per_length)
    _check_methods(model, every, recipe)  # each length's presets, before the first window
    calibrated_sinks = recipe.meta.get("settings", {}).get("sinks") if recipe is not None else None
    for s in specs:
        if needs_recipe(s) and calibrated_sinks is not None and s.sinks < calibrated_sinks:
            print(f"note: {s.name} quantizes the first {calibrated_sinks - s.sinks} token(s) of each sequence, which "
                  f"the recipe's statistics left out (calibrated with --sinks {calibrated_sinks}); calibrate with "
                  f"--sinks {s.sinks} to measure it like for like", file=sys.stderr)
    seen = set(recipe.meta.get("calibration_pieces", ())) if recipe is not None else set()
    overlap = sum(1 for d in text.evaluation_pieces if d in seen)
    if overlap:
        print(f"warning: {overlap} of the {len(text.evaluation_pieces)} evaluation pieces of {text.name} are in the "
              "text the recipe was calibrated on: these numbers are not on held-out text", file=sys.stderr)
    payloads = []
    for seqlen in seqlens:
        ew = evaluation_windows(tok, text, seqlen, args.max_windows)
        about = ew.describe()
        spread = f", {len(about['categories'])} categories" if about["categories"] else ""
        print(f"{args.model} on {text.name} (evaluation part): {about['windows']} of its {about['of']} windows of "
              f"{seqlen} tokens, spread over {about['pieces']} pieces{spread}")
        rows = evaluate(model, ew.ids, per_length[seqlen], recipe)
        print(format_table(rows))
        payloads.append({
            "model": args.model, "text": text.name, "seqlen": seqlen, "windows": int(ew.ids.shape[0]),
            "window_sources": about, "calibration_overlap": overlap, "recipe_sinks": calibrated_sinks,
            "rows": [r.as_dict() for r in rows],
        })
    if args.json:
        _write_json(args.json, payloads[0] if len(payloads) == 1 else {"runs": payloads})
    if args.plot:
        from .eval.plots import plot_ppl_by_length

        plot_ppl_by_length(payloads, args.plot)
        print(f"wrote {args.plot}")


def cmd_upgrade_recipe(args) -> None:
    """A recipe of format 1 rewritten as format 2: its tensors checked against their checksum, its model checked
    against the one weight hash format 1 kept (the first layer's keys), then every layer fingerprinted."""
    import hashlib

    import torch
    from safetensors.torch import load_file

    from .integrations.fingerprint import model_fingerprint
    from .integrations.loading import load_model
    from .integrations.parts import attention_modules, key_weight
    from .recipe import META_FILE, TENSORS_FILE, Recipe, RecipeError, probe_positions, same_weights
    from .shape import kv_shape

    d = Path(args.recipe)
    try:
        meta = json.loads((d / META_FILE).read_text())
        data = (d / TENSORS_FILE).read_bytes()
    except (OSError, ValueError) as exc:
        raise RecipeError(f"{d} holds no readable recipe ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format_version") != 1:
        raise RecipeError(f"{d} is not a recipe of format 1 (its format_version: "
                          f"{meta.get('format_version') if isinstance(meta, dict) else None!r}); nothing to upgrade")
    if meta.get("tensors_sha256") != hashlib.sha256(data).hexdigest():
        raise RecipeError(f"{d / TENSORS_FILE} does not match its checksum: recalibrate instead")
    old = (meta.get("model") or {}).get("fingerprint") or {}
    model, _ = load_model(args.model, args.dtype, args.device)
    first = key_weight(attention_modules(model)[0], kv_shape(model.config).channels).detach().float().cpu()
    flat = first.contiguous().view(-1)
    probe = flat[probe_positions(flat.numel(), torch.float32, 128)].tolist()  # format 1 kept 128
    then = {"layers_sha256": [old.get("k_proj_sha256")], "layers_probe": [old.get("k_proj_probe")]}
    now = {"layers_sha256": [hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]], "layers_probe": [probe]}
    if same_weights(then, now):
        raise RecipeError(f"{d} was calibrated on another model than {args.model}: recalibrate for this one")
    meta["model"]["fingerprint"] = model_fingerprint(model)
    recipe = Recipe(meta={k: v for k, v in meta.items() if k not in ("format_version", "tensors_sha256")},
                    tensors=load_file(str(d / TENSORS_FILE)))
    recipe.check()
    recipe.save(d)
    print(f"upgraded {d} to recipe format 2 (every layer fingerprinted on {args.model})")


def cmd_budget(args) -> None:
    from .recipe import RUN_LOCK_FILE, Recipe, writing

    budgets = _budgets(args.avg_bits)
    Recipe.load(args.recipe)  # a missing or broken recipe is named as such before any lock
    with writing(args.recipe, lock=RUN_LOCK_FILE, wait=False):  # no calibration may rewrite it under this run
        _budget(args, budgets, Recipe.load(args.recipe))


def _budget(args, budgets, recipe) -> None:
    from .eval.texts import load_text
    from .integrations.fingerprint import check_recipe
    from .integrations.loading import load_model

    model, tok = load_model(args.model, args.dtype, args.device)
    check_recipe(recipe, model)
    _check_context(model, [args.kl_seqlen], "--seqlen")
    calibrated_on = recipe.meta.get("text") or DEFAULT_TEXT
    if args.text is not None and args.text != calibrated_on:
        print(f"note: the recipe was calibrated on {calibrated_on!r}; its sensitivities are measured on "
              f"{args.text!r}, as asked")
    table = _measure_sensitivities(model, tok, recipe, load_text(args.text or calibrated_on, args.encoding), args)
    _store_budgets(recipe, budgets, args.kl_sinks, ("kl",))
    out = recipe.save(args.recipe)
    print(f"sensitivities of {len(table['kl'])} choices in {table['seconds']:.0f}s, written to {out}; methods "
          "nuq@AVG:kl and nuq@AVG:kl:chan read them")


def cmd_inspect(args) -> None:
    from .eval.plots import inspect_activations

    budgets = _budgets(args.avg_bits)
    if budgets:  # the recipe's choice for each budget; no model run needed
        from .methods.budget import describe, recipe_allocation
        from .eval.plots import plot_budget
        from .recipe import Recipe

        if not args.recipe:
            raise ValueError("--avg-bits plots a recipe's bit budget: pass --recipe DIR as well")
        recipe = Recipe.load(args.recipe)
        if "layer_windows" not in recipe.meta["model"]["fingerprint"]:
            # a recipe from before its fingerprint named each layer's window: a budget charges each layer for
            # what it holds, so the windows come from its model, once checked to be that model (--model)
            from .integrations.fingerprint import check_recipe
            from .integrations.loading import load_model

            check_recipe(recipe, load_model(args.model, args.dtype, args.device)[0])
        unit, tag = ("channel", ":chan") if args.chan else ("layer", "")
        proxy, tag = ("kl", ":kl" + tag) if args.kl else ("fisher", tag)
        for avg in budgets:
            alloc = recipe_allocation(recipe, avg, proxy=proxy, unit=unit)
            print(f"nuq@{avg:g}{tag} ({alloc.bits:.3f} bits per element at {alloc.tokens} tokens):")
            print(describe(alloc))
            name = f"budget_{avg:g}{tag.replace(':', '_')}.png"
            print(f"wrote {plot_budget(alloc, str(Path(args.out) / name))}")
        return
    for path in inspect_activations(args.model, args.text, args.out, layer=args.layer, seqlen=args.seqlen,
                                    dtype=args.dtype, device=args.device):
        print(f"wrote {path}")


def cmd_memory(args) -> None:
    from .eval.planner import run_memory_command

    _check_outputs(json=args.json)
    run_memory_command(args.model, args.context, args.methods, batch=args.batch, gpus=args.gpus,
                       gpu_mem=args.gpu_mem, json_out=args.json, recipe=args.recipe)


def cmd_passkey(args) -> None:
    from .eval.longctx import passkey_eval
    from .eval.passkey import format_passkey_table
    from .integrations.loading import load_model
    from .methods import PRESETS

    _check_outputs(json=args.json)
    names = [m.strip().lower() for m in args.methods.split(",") if m.strip()]
    lengths = _int_list(args.lengths, "--lengths")
    recipe_needs = _distinct(_per_length(args.methods, lengths))
    if args.trials < 1:
        raise ValueError("--trials must be at least 1")
    recipe = _recipe_for(recipe_needs, args.recipe)
    model, tok = load_model(args.model, args.dtype, args.device)
    per_length = _per_length(args.methods, lengths, model)  # a preset chosen for each length and this model
    every = _distinct(per_length)
    _check_methods(model, every, recipe)
    results = []
    for n in lengths:  # the same prompts for every method of a length; a preset's row under the name given
        label = {s.name: m if m in PRESETS else s.name for s, m in zip(per_length[n], names)}
        results += [dataclasses.replace(r, method=label[r.method]) for r in
                    passkey_eval(model, tok, per_length[n], [n], args.trials, recipe, seed=args.seed,
                                 engine=args.engine)]
    print(format_passkey_table(results))
    _write_json(args.json, {
        "model": args.model, "trials": args.trials, "seed": args.seed,
        "presets": {m: {n: s.name for n in lengths for s, m2 in zip(per_length[n], names) if m2 == m}
                    for m in names if m in PRESETS},
        "passkey": [{"method": r.method, "length": r.length, "accuracy": r.accuracy, "trials": r.trials}
                    for r in results],
    })


def cmd_ruler(args) -> None:
    from .eval.ruler import TASKS, build_contexts
    from .eval.ruler_eval import ENGINES, AnswerLog, format_ruler_table, ruler_eval, summarize
    from .eval.texts import load_text
    from .integrations.loading import load_model
    from .methods import PRESETS

    _check_outputs(json=args.json, plot=args.plot)
    names = [m.strip().lower() for m in args.methods.split(",") if m.strip()]
    lengths = _int_list(args.lengths, "--lengths")
    recipe_needs = _distinct(_per_length(args.methods, lengths))
    tasks = list(TASKS) if args.tasks == "all" else [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"--tasks: unknown task(s) {', '.join(unknown)}; choose from {', '.join(TASKS)} or 'all'")
    if args.samples < 1:
        raise ValueError("--samples must be at least 1")
    if args.engine not in ENGINES:
        raise ValueError(f"--engine must be one of {', '.join(ENGINES)}")
    haystack = load_text(args.text, args.encoding).evaluation
    recipe = _recipe_for(recipe_needs, args.recipe)
    log = AnswerLog(args.answers)  # a bad file is refused before the model loads
    model, tok = load_model(args.model, args.dtype, args.device)
    per_length = _per_length(args.methods, lengths, model)  # a preset chosen for each length and this model
    every = _distinct(per_length)
    _check_methods(model, every, recipe)  # each length's presets, before the first context
    _check_context(model, lengths, "--lengths")
    contexts = {n: build_contexts(tok, haystack, n, args.samples, seed=args.seed, tasks=tasks, layout=args.layout)
                for n in lengths}
    answers = []
    for sample in range(args.samples):  # sample-major: a stopped run is balanced over lengths
        for n in lengths:
            at = per_length[n]
            answers += ruler_eval(model, tok, at, [c for c in contexts[n] if c.sample == sample], recipe,
                                  engine=args.engine, chunk=args.chunk, model_name=args.model, log=log,
                                  labels={sp.name: m for sp, m in zip(at, names) if m in PRESETS},
                                  prefill_store=args.prefills)
    scores = summarize(answers)
    print(format_ruler_table(scores))
    if args.by_task:
        for t in tasks:
            print()
            print(format_ruler_table(scores, task=t))
    _write_json(args.json, {
        "model": args.model, "engine": args.engine, "layout": args.layout, "samples": args.samples, "seed": args.seed, "tasks": tasks,
        "rows": [{"method": s.method, "task": s.task, "length": s.length, "samples": s.samples, "score": s.score,
                  **({"ci95": list(s.ci95)} if s.ci95 else {})} for s in scores],
    })
    if args.plot:
        from .eval.plots import plot_ruler

        print(f"wrote {plot_ruler(scores, args.plot)}")


def cmd_generate(args) -> None:
    import torch

    from .integrations.cache import cache_for, check_supported
    from .integrations.loading import load_model
    from .integrations.preflight import model_windows
    from .methods import parse_method, preset_reaching
    from .recipe import Recipe

    spec = parse_method(args.method)
    check_supported(spec)  # before any loading
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if not args.prompt.strip():
        raise ValueError("--prompt is empty; give some text to continue")
    recipe = Recipe.load(args.recipe) if args.recipe else None
    model, tok = load_model(args.model, args.dtype, args.device)
    enc = tok(args.prompt, return_tensors="pt").to(next(model.parameters()).device)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    # a preset named without ':ctxN' spends its bits at the length this generation reaches, the prompt and every
    # new token, its fp16 window sized for the tokens this model's layers hold
    spec = preset_reaching(args.method, enc["input_ids"].shape[1] + args.max_new_tokens, model_windows(model))
    with cache_for(model, recipe, spec) as cache, torch.no_grad():
        fused = None
        if args.decode != "dense" and spec.quantized:
            from .integrations.fused import enable_fused_decode

            fused = enable_fused_decode(model, cache, backend=args.decode)
        try:
            out = model.generate(enc["input_ids"], attention_mask=enc["attention_mask"], cache=cache,
                                 max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad)
        finally:
            if fused is not None:
                fused.close()
        report = cache.memory_report()
    print(args.prompt + tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))
    print()
    print(report.format())


def _add_loading(sub: argparse.ArgumentParser) -> None:
    """--dtype and --device: how every command that loads a model loads it."""
    sub.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE, help="precision the model is loaded in")
    sub.add_argument("--device", default=DEFAULT_DEVICE, help="where the model runs: cpu, cuda, cuda:1, ...")


def _add_sensitivity(sub: argparse.ArgumentParser, standalone: bool) -> None:
    """What `kvsqueeze budget` (standalone) and `calibrate --kl` measure: plain flags in `budget`, `--kl-*` in
    `calibrate` (where --bits, --outliers, --seqlen and --sinks name the calibration's own)."""
    pre = "--" if standalone else "--kl-"
    # calibrate's are None unless given (refused without --kl); _kl_windows / _kl_seqlen give their defaults
    sub.add_argument(f"{pre}windows", dest="kl_windows", type=_bounded(1, 10_000),
                     default=KL_WINDOWS if standalone else None,
                     help=f"calibration windows the KL divergence is taken over (default {KL_WINDOWS})")
    sub.add_argument(f"{pre}seqlen", dest="kl_seqlen", type=_bounded(2, MAX_TOKENS),
                     default=KL_SEQLEN if standalone else None, help=f"tokens per window (default {KL_SEQLEN})")
    sub.add_argument(f"{pre}bits", dest="kl_bits", help="widths to measure (default: the recipe's middle one, 3; "
                     "each unit's scale is the mean over those measured)")
    sub.add_argument(f"{pre}outliers", dest="kl_outliers", help="outlier percentages to measure besides none "
                     "(default: the recipe's largest)")
    if standalone:
        sub.add_argument("--sinks", dest="kl_sinks", type=_bounded(0, MAX_SINKS), default=1,
                         help="fp16 sinks of the budgets that will read them")
    else:
        sub.set_defaults(kl_sinks=1)  # the sinks of nuq@AVG methods by default


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvsqueeze", description="KVQuant-style KV-cache quantization")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("calibrate", help="Fisher information, ranges, outlier thresholds and nuq codebooks")
    c.add_argument("--model", default=DEFAULT_MODEL, help="'smollm2-135m', a HF model id or a local directory")
    _add_loading(c)
    c.add_argument("--text", default=DEFAULT_TEXT, help=TEXT_HELP.format(part="calibration part"))
    c.add_argument("--out", required=True, help="directory for recipe.safetensors + recipe.json")
    c.add_argument("--samples", type=_bounded(1, 10_000), default=_CAL.samples)
    c.add_argument("--seqlen", type=_bounded(2, MAX_TOKENS), default=_CAL.seqlen)
    c.add_argument("--bits", default=",".join(map(str, _CAL.bits)))
    c.add_argument("--outliers", default=",".join(f"{100 * f:g}" for f in _CAL.fractions if f),
                   help="outlier percentages to calibrate, e.g. 0.1,1")
    c.add_argument("--sinks", type=_bounded(0, MAX_SINKS), default=_CAL.sinks, help="leading tokens left out of statistics")
    c.add_argument("--avg-bits", help="also choose and store each layer's K/V bits for these averages "
                                      "(e.g. 3.5 or 2.6,3.5): the method nuq@3.5 reads the choice")
    c.add_argument("--ablation", action="store_true", help="also fit what only the ablation ladder reads: "
                   "codebooks weighted by Fisher alone (':fisher') or not at all (':unw'), and per-matrix ones (':pm')")
    c.add_argument("--kl", action="store_true", help="also measure each layer's sensitivity, as `kvsqueeze budget` "
                   "does (about 100 s on the default model), for budgets nuq@AVG:kl and nuq@AVG:kl:chan")
    _add_sensitivity(c, standalone=False)
    c.set_defaults(fn=cmd_calibrate)

    e = sub.add_parser("eval", help="perplexity of each method (simulated quantization)")
    e.add_argument("--model", default=DEFAULT_MODEL)
    _add_loading(e)
    e.add_argument("--text", default=DEFAULT_TEXT, help=TEXT_HELP.format(part="evaluation part"))
    e.add_argument("--recipe", help="recipe directory (needed by nuq and per-channel methods)")
    e.add_argument("--methods", default=_EVAL.methods,
                   help="comma-separated method names; a preset (q3.5) is chosen for each --seqlen, at least 2,048")
    e.add_argument("--seqlen", default=_EVAL.seqlen, help="window length(s), e.g. 2048 or 1024,2048,4096")
    e.add_argument("--max-windows", type=_bounded(1), default=_EVAL.max_windows)
    e.add_argument("--json", help="write the results as JSON here")
    e.add_argument("--plot", help="PNG of PPL against window length (with several --seqlen)")
    e.set_defaults(fn=cmd_eval)

    u = sub.add_parser("upgrade-recipe", help="rewrite a recipe of an earlier format (1) in today's, checked "
                                              "against its model")
    u.add_argument("--model", default=DEFAULT_MODEL)
    _add_loading(u)
    u.add_argument("--recipe", required=True)
    u.set_defaults(fn=cmd_upgrade_recipe)

    b = sub.add_parser("budget", help="measure each layer's sensitivity for bit budgets nuq@AVG:kl and "
                                      "nuq@AVG:kl:chan (into the recipe)")
    b.add_argument("--model", default=DEFAULT_MODEL)
    _add_loading(b)
    b.add_argument("--recipe", required=True, help="the model's recipe; the measurements are added to it")
    b.add_argument("--text", default=None, help=TEXT_HELP.format(part="calibration part")
                   + " (default: the text the recipe was calibrated on)")
    _add_sensitivity(b, standalone=True)
    b.add_argument("--avg-bits", help="also store the choices of these budgets, e.g. 2.6,3.5")
    b.set_defaults(fn=cmd_budget)

    i = sub.add_parser("inspect", help="plots of key/value channel magnitudes and distributions")
    i.add_argument("--model", default=DEFAULT_MODEL)
    _add_loading(i)
    i.add_argument("--text", default=DEFAULT_TEXT)
    i.add_argument("--out", required=True)
    i.add_argument("--layer", type=_bounded(0), default=_INSPECT.layer, help="layer for the per-channel plot (default: middle)")
    i.add_argument("--seqlen", type=_bounded(2, MAX_TOKENS), default=_INSPECT.seqlen)
    i.add_argument("--recipe", help="with --avg-bits: the recipe whose bit budget to show")
    i.add_argument("--avg-bits", help="plot the bits per layer of these budgets (nuq@B) instead of activations")
    i.add_argument("--kl", action="store_true", help="with --avg-bits: the budgets that read the sensitivities "
                   "`kvsqueeze budget` measured (nuq@B:kl, or with --chan nuq@B:kl:chan)")
    i.add_argument("--chan", action="store_true", help="with --avg-bits: the budgets with a width per channel "
                   "(nuq@B:chan), each layer's mean width and its channels' widths")
    i.set_defaults(fn=cmd_inspect)

    k = sub.add_parser("passkey", help="passkey retrieval accuracy per method and prompt length")
    k.add_argument("--model", default=DEFAULT_MODEL)
    _add_loading(k)
    k.add_argument("--recipe")
    k.add_argument("--methods", default=_PASSKEY.methods)
    k.add_argument("--lengths", default=_PASSKEY.lengths)
    k.add_argument("--trials", type=_bounded(1, 10_000), default=_PASSKEY.trials)
    k.add_argument("--seed", type=int, default=_PASSKEY.seed)
    k.add_argument("--engine", choices=("sim", "cache"), default=_PASSKEY.engine,
                   help="simulated quantization, or the compressed cache where the method has one")
    k.add_argument("--json")
    k.set_defaults(fn=cmd_passkey)

    r = sub.add_parser("ruler", help="RULER-style long-context suite (needles, variable tracking, word counts) "
                                     "through each method's cache")
    r.add_argument("--model", default=DEFAULT_MODEL)
    _add_loading(r)
    r.add_argument("--recipe", help="recipe directory (needed by nuq and per-channel methods)")
    r.add_argument("--methods", default=_RULER.methods)
    r.add_argument("--lengths", default=_RULER.lengths, help="sequence lengths in tokens, e.g. 4096,8192,16384")
    r.add_argument("--tasks", default=_RULER.tasks, help="'all' or a comma-separated subset of the suite's tasks")
    r.add_argument("--samples", type=_bounded(1, 10_000), default=_RULER.samples, help="contexts of each kind per length")
    r.add_argument("--seed", type=int, default=_RULER.seed)
    r.add_argument("--layout", choices=("separate", "shared", "many"), default=_RULER.layout,
                   help="separate: a context per needle task (as RULER); shared: one context carries every needle "
                        "task's needles (one prefill instead of seven; harder: each question meets the others' "
                        "needles); many: as shared, with 24 questions a context (several of each task)")
    r.add_argument("--text", default=DEFAULT_TEXT, help="haystack: " + TEXT_HELP.format(part="evaluation part"))
    r.add_argument("--engine", default=_RULER.engine,
                   help="dense-prefill (one exact prefill shared by every method), chunked (each method prefills "
                        "through its own cache) or sim (every method through the simulated path)")
    r.add_argument("--chunk", type=_bounded(1, MAX_TOKENS), default=_RULER.chunk, help="prefill chunk in tokens")
    r.add_argument("--answers", help="JSONL file every answer is appended to; a rerun with it resumes")
    r.add_argument("--prefills", help="folder where each context's prefill waits until every method has answered "
                                      "it, so that a stopped run does not prefill it again (dense-prefill)")
    r.add_argument("--by-task", action="store_true", help="also print one table per task")
    r.add_argument("--json")
    r.add_argument("--plot", help="PNG of the average score against length per method")
    r.set_defaults(fn=cmd_ruler)

    m = sub.add_parser("memory", help="KV-cache memory planner")
    m.add_argument("--model", default=_MEM.model, help="built-in shape name or a config.json path")
    m.add_argument("--context", default=_MEM.contexts)
    m.add_argument("--methods", default=_MEM.methods)
    m.add_argument("--batch", type=_bounded(1, 1 << 20), default=_MEM.batch)
    m.add_argument("--gpus", type=_bounded(1, 1 << 16), default=_MEM.gpus)
    m.add_argument("--gpu-mem", default=_MEM.gpu_mem)
    m.add_argument("--recipe", help="a recipe of the model: what bit budgets (nuq@B) read their choice from")
    m.add_argument("--json")
    m.set_defaults(fn=cmd_memory)

    g = sub.add_parser("generate", help="greedy generation through the compressed KV cache, with its memory report")
    g.add_argument("--model", default=DEFAULT_MODEL)
    _add_loading(g)
    g.add_argument("--recipe", help="recipe directory (needed by nuq and per-channel int/nf methods)")
    g.add_argument("--method", default=_GEN.method,
                   help="fp16, a preset (q4.5, q3.5, q2.5: chosen for the prompt and new tokens, at least 2,048) or "
                        "a KVQuant-style method, e.g. nuq3-1%%")
    g.add_argument("--prompt", required=True, help="text to continue")
    g.add_argument("--max-new-tokens", type=_bounded(0, MAX_TOKENS), default=_GEN.max_new_tokens)
    g.add_argument("--decode", choices=("auto", "numba", "reference", "dense"), default=_GEN.decode,
                   help="decode attention: the fused kernel over the compressed cache (auto picks the fastest "
                        "backend) or dense attention over the dequantized cache")
    g.set_defaults(fn=cmd_generate)
    for cmd in (c, e, b, i, r):
        cmd.add_argument("--encoding", help="encoding of a --text file (default: UTF-8, decoded strictly)")
    return p


def main(argv: list[str] | None = None) -> int:
    from .eval.texts import TextError
    from .integrations.loading import ModelLoadError
    from .integrations.preflight import UnsupportedModelError
    from .methods import MethodError
    from .recipe import RecipeError

    args = build_parser().parse_args(argv)
    try:
        args.fn(args)
    except (MethodError, RecipeError, TextError, ModelLoadError, UnsupportedModelError, FloatingPointError, ValueError,
            OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
