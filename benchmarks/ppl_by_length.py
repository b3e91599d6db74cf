"""Perplexity against window length on the 32K-context model: does a method lose more at 32K than at 2K?

    python benchmarks/ppl_by_length.py [--model qwen2.5-coder-0.5b] [--recipe out/models/qwen2.5-coder-0.5b/recipe]
        [--methods fp16,nuq3-1%,q4.5,q3.5,q2.5,kivi2] [--lengths 2048,8192,16384,32768] [--tokens 65536]
        [--segment 1024] [--check-length 8192] [--check-methods nuq3-1%,q3.5]
        [--json benchmarks/results/ppl_by_length.json]

At each length, `--tokens` evaluation tokens of the text (`--text`, default the BBC evaluation part) in windows
of that length spread evenly over it (32 windows of 2K, 2 of 32K; measured in an order where each next window
halves the largest gap, so a stopped run covers the whole text), each one teacher-forced through every method's
simulated cache (keys and values quantized as the method stores them; presets resolve for the window's length)
and scored segment by segment against the fp16 cache on the same window (`kvsqueeze.eval.long_ppl`): PPL, its
change with a paired 95% interval (over the windows where a length has several, each window one cluster; over
one window's `--segment`-token blocks where it has one, which says how that one text varies, not how texts
vary), KL divergence, top-1, and the average bits the cache holds at that length, every component counted.

One check against the engine users run: on the first window of `--check-length`, each of `--check-methods` is
also run through the compressed cache (`cache_for`, the store `generate` uses) and its per-token NLL compared
with the simulated path's (`cache_check`).

Each (length, window, method) is one forward of up to 32K tokens (about 10-15 minutes for the 0.5B model on 2
cores), appended to `<json stem>_windows.jsonl` as it finishes; a run resumes from there. The fp16 reference of
the window in progress (its final hidden states, one more such forward) is kept in `--reference-store` until
every method has been scored on that window, so a run stopped in between does not compute it again. Each record
names the recipe's content digest (`recipe_sha256`), the text and its window's token ids (`ids_sha256`); a run
given a recipe other than the one the records name, or another `--text` / `--tokens` than the JSON's, stops before
the model loads, and a window whose ids differ from its records' stops before it is scored. Every method of a
length is summarised over the windows all of them have. `--summarize-only` rebuilds the JSON's rows from the
records, without the model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, read_records, same_recipe  # noqa: E402

METHODS = "fp16,nuq3-1%,q4.5,q3.5,q2.5,kivi2"


def aggregate(records: list[dict], methods: list[str], lengths: list[int]) -> list[dict]:
    """Per (method, length): PPL over its windows, the change against fp16 with its paired interval (over
    windows where there are several, over one window's segments where there is one: `ci95_over`), mean KL
    divergence, top-1 and average held bits. At each length every method is taken over the
    same windows, those every method measured there has (fp16 among them), so that two rows of a length compare
    methods on the same text; `methods` come first, then any other the records hold."""
    import torch

    from kvsqueeze.eval.perplexity import paired_interval

    rows = []
    methods = list(dict.fromkeys([*methods, *(r["method"] for r in records)]))
    for length in lengths:
        at = {(r["method"], r["window"]): r for r in records if r["length"] == length}
        present = [m for m in methods if any(k[0] == m for k in at)]
        shared = set.intersection(*({w for (m, w) in at if m == meth} for meth in present)) if present else set()
        for method in methods:
            windows = sorted(shared) if "fp16" in present and method in present else []
            if not windows:
                continue
            mine = [at[(method, w)] for w in windows]
            base = [at[("fp16", w)] for w in windows]
            if len(windows) > 1:  # a window's segments share its text and cache: the windows are the clusters
                over = "windows"
                nll, ref, tok = (torch.tensor([sum(r[k]) for r in rs], dtype=torch.float64)
                                 for rs, k in ((mine, "nll"), (base, "nll"), (mine, "tokens")))
            else:  # one window: its segments, an interval about that one text only
                over = "segments of one window"
                nll, ref, tok = (torch.tensor(rs[0][k], dtype=torch.float64)
                                 for rs, k in ((mine, "nll"), (base, "nll"), (mine, "tokens")))
            count = float(tok.sum())
            ppl, ppl_ref = math.exp(float(nll.sum()) / count), math.exp(float(ref.sum()) / count)
            paired = method != "fp16" and nll.shape == ref.shape  # segments of another --segment do not pair
            ci = paired_interval(nll, ref, tok) if paired else None
            rows.append({"method": method, "resolved": mine[0]["resolved"], "length": length, "windows": len(windows),
                         "tokens": int(count), "avg_bits": round(sum(r["held_bits"] for r in mine)
                                                                 / sum(r["elements"] for r in mine), 4),
                         "ppl": round(ppl, 4), "delta_pct": round(100 * (ppl / ppl_ref - 1), 3),
                         "ci95": None if ci is None else [round(x, 3) for x in ci],
                         **({"ci95_over": over} if ci is not None else {}),
                         "kld_mean": round(sum(r["kld_sum"] for r in mine) / count, 5),
                         "top1": round(sum(r["top1"] for r in mine) / count, 4)})
    return rows


def spread_order(n: int) -> list[int]:
    """The indices 0 .. n - 1 of evenly spread windows in the order a stopped run should measure them: each next
    one halves the largest gap (bit-reversed order), so that a partial run covers the whole text, not its start
    (the BBC evaluation part runs topic by topic)."""
    bits = max(1, (n - 1).bit_length())
    rev = sorted(range(1 << bits), key=lambda i: int(f"{i:0{bits}b}"[::-1], 2))
    return [i for i in rev if i < n]


def machines_by_length(records: list[dict]) -> dict[str, str]:
    """{length: the machines its windows were measured on, '; '-joined}; a window without a machine is refused
    (every record names one)."""
    out: dict[str, set] = {}
    for r in records:
        if not r.get("machine"):
            raise SystemExit(f"the window record {r['length']}/{r['window']}/{r['method']} names no machine")
        out.setdefault(str(r["length"]), set()).add(r["machine"])
    return {n: "; ".join(sorted(ms)) for n, ms in sorted(out.items(), key=lambda kv: int(kv[0]))}


def summarize(result: dict, records: list[dict], methods: list[str], lengths: list[int], log: Path) -> None:
    """The JSON's summary of the window records, into `result`."""
    result["machines"] = machines_by_length(records)  # from the windows themselves: each names its machine
    result["machine"] = "; ".join(sorted({r["machine"] for r in records}))
    result["rows"] = aggregate(records, methods, sorted(set(lengths) | {r["length"] for r in records}))
    result["windows_log"] = log.name
    # windows scored before the records named their recipe and token ids: no run check covered them
    result["unchecked_windows"] = sum(1 for r in records if not r.get("recipe_sha256") or not r.get("ids_sha256"))


def write_json(out: Path, result: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(out)  # never half-written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--summarize-only", action="store_true", help="rebuild the JSON's rows from the window records")
    ap.add_argument("--recipe", default="out/models/qwen2.5-coder-0.5b/recipe")
    ap.add_argument("--text", default="bbc")
    ap.add_argument("--methods", default=METHODS)
    ap.add_argument("--lengths", default="2048,8192,16384,32768")
    ap.add_argument("--tokens", type=int, default=65536, help="evaluation tokens at every length")
    ap.add_argument("--segment", type=int, default=1024, help="tokens per block of the paired interval")
    ap.add_argument("--check-length", type=int, default=8192)
    ap.add_argument("--check-methods", default="nuq3-1%,q3.5")
    ap.add_argument("--json", default="benchmarks/results/ppl_by_length.json")
    ap.add_argument("--reference-store", default="out/ppl-by-length-references",
                    help="folder for the fp16 reference of the window in progress ('' : keep none)")
    args = ap.parse_args(argv)

    from kvsqueeze.methods import preset_for

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if "fp16" not in methods:
        methods.insert(0, "fp16")
    lengths = sorted(int(x) for x in args.lengths.split(","))
    checks = [m.strip() for m in args.check_methods.split(",") if m.strip()]
    for name in methods + checks:
        for length in lengths:
            preset_for(name, length, ())  # a typo is refused before the model loads
    if args.segment < 1 or any(n < 2 for n in lengths) or args.tokens < max(lengths):
        raise SystemExit("--segment must be positive, lengths at least 2, and --tokens at least the longest length")

    import torch

    from kvsqueeze.eval.long_ppl import check_head, hidden_states, score_window
    from kvsqueeze.eval.texts import evaluation_windows, load_text
    from kvsqueeze.integrations.cache import cache_for
    from kvsqueeze.integrations.loading import load_model
    from kvsqueeze.integrations.preflight import model_windows
    from kvsqueeze.integrations.simulate import SimulatedQuantization
    from kvsqueeze.recipe import Recipe

    out = Path(args.json)
    log = out.with_name(out.stem + "_windows.jsonl")
    records = read_records(log, repair=not args.summarize_only)
    logged = json.loads(out.read_text()).get("segment", 1024) if out.is_file() else args.segment
    segments = {r.get("segment", logged) for r in records} - {args.segment}  # older records: the JSON's
    if segments:
        raise SystemExit(f"the windows in {log} were scored in segments of {sorted(segments)} tokens, this run asks "
                         f"for --segment {args.segment}: run with that, or with another --json")
    done = {(r["length"], r["window"], r["method"]) for r in records}
    recipe = Recipe.load(args.recipe)
    digest = recipe.meta.get("tensors_sha256")
    same_recipe(args.recipe, digest, (r.get("recipe_sha256") for r in records),
                f"the windows in {log} were scored with", "Run with that recipe, or with another --json for this one")
    if out.is_file():  # the windows of another text or spread are other windows under the same (length, index)
        before = json.loads(out.read_text())
        held = (before.get("text", "bbc"), before.get("tokens_per_length", 65536))
        if held != (args.text, args.tokens):
            raise SystemExit(f"{out} holds windows of --text {held[0]} --tokens {held[1]}, this run asks for --text "
                             f"{args.text} --tokens {args.tokens}: its windows would be paired with those; run with "
                             "those settings, or with another --json")
    if args.summarize_only:
        if not out.is_file():
            raise SystemExit(f"no {out} to summarize")
        result = json.loads(out.read_text())
        summarize(result, records, methods, lengths, log)
        write_json(out, result)
        print(f"wrote {out}")
        return 0
    model, tok = load_model(args.model)
    from kvsqueeze.shape import context_length

    limit = context_length(model.config)
    if limit and max(lengths) > limit:  # positions past it were never trained: their PPL says nothing
        raise SystemExit(f"--lengths {max(lengths)} is past {args.model}'s {limit}-token context; use lengths up to "
                         f"{limit}")
    windows = model_windows(model)  # a preset's fp16 window follows the tokens the model's layers hold
    moved = sorted({(r["method"], r["length"], r["resolved"]) for r in records if "resolved" in r
                    and preset_for(r["method"], r["length"], windows).name != r["resolved"]})
    if moved:
        m, n, was = moved[0]
        raise SystemExit(f"{log} scored {m} at {n} tokens as {was}; on {args.model} it is now "
                         f"{preset_for(m, n, windows).name}: run with another --json")
    text = load_text(args.text)
    fp16 = preset_for("fp16", 2, ())
    check_head(model, torch.arange(100, 164).view(1, -1),
               lambda: SimulatedQuantization(model, fp16, recipe).new_cache())
    result = {"model": args.model, "recipe": args.recipe, "text": args.text, "machine": machine(),
              "threads": torch.get_num_threads(), "segment": args.segment, "tokens_per_length": args.tokens,
              "command": "python benchmarks/ppl_by_length.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    here = result["machine"]
    if out.is_file():  # a run over some lengths keeps what earlier runs measured at the others
        before = json.loads(out.read_text())
        result["cache_check"] = before.get("cache_check", [])
        result["windows"] = before.get("windows", {})

    def write() -> None:
        summarize(result, records, methods, lengths, log)
        write_json(out, result)

    for length in lengths:
        ew = evaluation_windows(tok, text, length, max(1, args.tokens // length))
        result.setdefault("windows", {})[str(length)] = {"windows": int(ew.ids.shape[0]), "of": ew.available}
        for w in spread_order(int(ew.ids.shape[0])):
            ids = ew.ids[w].view(1, -1)
            ids_sha = hashlib.sha256(ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()[:16]
            other = {r["ids_sha256"] for r in records
                     if (r["length"], r["window"]) == (length, w) and "ids_sha256" in r}
            if other - {ids_sha}:
                raise SystemExit(f"window {w} of {length} tokens was scored on other token ids ({sorted(other)}) than "
                                 f"this run's ({ids_sha}): another text or tokenizer; run with another --json")
            todo = [m for m in methods if (length, w, m) not in done]
            need_check = length == args.check_length and w == 0 and not result.get("cache_check")
            if not todo and not need_check:
                continue
            ref_sim = SimulatedQuantization(model, fp16, recipe)
            stored = (Path(args.reference_store) / f"{args.model}.{args.text}.{length}.{w}.safetensors"
                      if args.reference_store else None)
            reference, ref_s = stored_reference(stored, ids)
            if reference is None:
                t0 = time.perf_counter()
                with ref_sim as sim:
                    reference = hidden_states(model, ids, sim.new_cache())
                ref_s = time.perf_counter() - t0
                keep_reference(stored, ids, reference, ref_s)
            for method in todo:
                spec = preset_for(method, length, windows)
                t1 = time.perf_counter()
                if method == "fp16":
                    hidden, elements = reference, ref_sim.elements(length)
                    held = 8 * sum(ref_sim.storage(length).values())
                else:
                    with SimulatedQuantization(model, spec, recipe) as sim:
                        hidden = hidden_states(model, ids, sim.new_cache())
                        held, elements = 8 * sum(sim.storage(length).values()), sim.elements(length)  # outliers kept
                score = score_window(model, ids, hidden, reference, args.segment)
                score.held_bits, score.elements = held, elements
                seconds = (time.perf_counter() - t1) + (ref_s if method == "fp16" else 0.0)
                rec = {"length": length, "window": w, "method": method, "resolved": spec.name,
                       "seconds": round(seconds, 1), "recipe_sha256": digest, "text": args.text,
                       "ids_sha256": ids_sha, "machine": here, "segment": args.segment, **score.as_dict()}
                records.append(rec)
                done.add((length, w, method))
                with log.open("a") as f:
                    f.write(json.dumps(rec) + "\n")
                print(f"{length} window {w} {method}: NLL {sum(score.nll) / sum(score.tokens):.4f} "
                      f"({seconds:.0f} s)", flush=True)
                write()
            if need_check:
                checks_out = []
                for method in checks:
                    spec = preset_for(method, length, windows)
                    with SimulatedQuantization(model, spec, recipe) as sim:
                        simulated = hidden_states(model, ids, sim.new_cache())
                    cache = cache_for(model, recipe, spec)
                    engine = hidden_states(model, ids, cache)
                    a = score_window(model, ids, simulated, reference, args.segment)
                    b = score_window(model, ids, engine, reference, args.segment)
                    na, nb = sum(a.nll) / sum(a.tokens), sum(b.nll) / sum(b.tokens)
                    checks_out.append({"method": method, "resolved": spec.name, "length": length, "window": 0,
                                       "nll_simulated": round(na, 6), "nll_compressed_cache": round(nb, 6),
                                       "ppl_ratio": round(math.exp(nb - na), 6),
                                       "hidden_max_abs_diff": float((simulated - engine).abs().max())})
                    print("cache check:", checks_out[-1], flush=True)
                result["cache_check"] = checks_out
                write()
            if stored is not None:
                stored.unlink(missing_ok=True)  # every method of this run has been scored on this window
    write()
    return 0


def stored_reference(path: Path | None, ids) -> tuple:
    """(the reference hidden states `keep_reference` kept for these ids, the seconds they took), or (None, 0.0)
    where none are kept (or what is kept belongs to other tokens: then it is deleted)."""
    import torch
    from safetensors.torch import load_file

    if path is None or not path.is_file():
        return None, 0.0
    try:
        named = load_file(str(path))
        if torch.equal(named["ids"], ids.cpu()):
            return named["hidden"], float(named["seconds"])
    except Exception:  # noqa: BLE001 - unreadable or another run's: computed again
        pass
    path.unlink()
    return None, 0.0


def keep_reference(path: Path | None, ids, hidden, seconds: float) -> None:
    """Write the window's reference through a temporary name (never half-written)."""
    import torch
    from safetensors.torch import save_file

    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({"ids": ids.cpu().contiguous(), "hidden": hidden.detach().cpu().contiguous(),
               "seconds": torch.tensor(seconds, dtype=torch.float64)}, str(tmp))
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
