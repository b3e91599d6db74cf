"""The RULER-style suite on the default model (to its 8K limit) and a 32K-context model, with enough paired
questions per cell to tell methods apart.

    python benchmarks/ruler.py [--samples 4] [--methods fp16,nuq3-1%,q4.5,q3.5,q2.5,kivi2,turbo3:split,int4]
        [--run smollm2-135m:out/recipe:4096,8192:many]
        [--run qwen2.5-coder-0.5b:out/models/qwen2.5-coder-0.5b/recipe:4096,8192,16384,32768:many]
        [--answers benchmarks/results/ruler_answers.jsonl] [--json benchmarks/results/ruler.json]
        [--summarize-only]

Every context is built from the held-out part of the BBC corpus and a seed (`kvsqueeze.eval.ruler`). Layout
`many` (the default): per sample, one `needles` context asks 24 questions (five single-number, five single-word
and three single-uuid needles, four multi-key needles among three rivals each, two multi-value and two
multi-query needles, three variable-tracking chains; each question's needles its own, among all the others')
and a `words` context asks the common- and frequent-words questions: 26 paired questions a sample, 104 at 4
samples, from 8 prefills a length. Each context is prefilled once with exact attention and each method
answers from its own cache holding those keys and values (`--engine dense-prefill`; the compressed cache with
the fused numba kernel for nuq and the presets, the simulated cache for KIVI, turbo and per-token int4), the
cache cropped back to the context after each batch. The questions of a context whose question has the same
number of tokens are answered together, one row each over repeated copies of the method's cache (`--rows`
rows at most, and as many as `--row-gb` of repeated caches hold): one forward reads the model's weights for
all of them, which is what an answer costs on a CPU. Greedy answers, scored as RULER does (the share of the
expected strings found).

Presets (`q4.5`, `q3.5`, `q2.5`: `kvsqueeze.methods.PRESETS`) are chosen for each length they run at and for
the tokens the model's layers hold (`q3.5` at 8,192 tokens is `nuq@3.5:r32:chan:ctx8k` where every layer holds
every token); their answers are logged under the preset's name.

The run is sample-major (sample 0 at every length of every model, then sample 1, ...) and appends each answer
to `--answers` as it is made: stopped anywhere, it resumes there, and what it has is balanced over lengths.
Each answer names its context and question by a digest of their text (`context`), so answers made over another
haystack, task set or layout are not resumed from; the summary refuses a file in which one question slot
(model, length, sample, task, item) holds answers over two contexts. Tables hold the questions every method run
on a model at a length has answered, of the samples every such method has finished (the JSON's config counts
what waits: `answers_pending`, `samples_partial`, and `missing` methods).
A context's prefill waits in `--prefills` until every method has answered it, so a run stopped in between
(a 32K prefill of the 0.5B model takes about 15 minutes) starts from it. `--summarize-only` rebuilds the JSON
and the plot from the answers file. Each (model, length, sample)'s wall
time is kept beside the answers (`<answers>_timing.jsonl`) and summed in the JSON (`cost`), with the content
digest of the recipe its quantized answers came from (`tensors_sha256`): a run whose recipe is another than
the one the model's earlier records name stops before any work, since its answers would join answers of another
recipe under the same method names (`experiments/ruler_recipe_check.py` tells whether a recipe calibrated again
answers as the logged one did).

Per (model, method, length) the JSON's `paired` rows give: the questions answered by both the method and fp16,
the mean difference in points with its 95% interval over samples (`samples`: a sample's contexts, one prefill
each, share their quantized caches, so their questions count together; Student's t on the samples' spread, none
with one sample), the share of fp16's mean score,
and the method's score on the questions fp16 answers fully (`on_fp16_right`, out of `fp16_right`);
`paired_by_answers` splits them into the questions asking for one string and those asking for several.

On a GPU (bf16, the Triton kernels; the first result of each kernel variant is checked against the
reference backend):

    python benchmarks/ruler.py --device cuda --dtype bfloat16 --answers out/ruler-gpu/answers.jsonl \
        --json benchmarks/results/ruler_gpu.json --plot benchmarks/results/ruler_gpu.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kvsqueeze.eval.plots import plot_ruler
from kvsqueeze.eval.ruler import LAYOUTS, TASKS, build_contexts
from kvsqueeze.eval.ruler_eval import AnswerLog, format_ruler_table, paired, ruler_eval, summarize
from kvsqueeze.eval.texts import load_text
from kvsqueeze.integrations.preflight import model_windows
from kvsqueeze.methods import PRESETS, parse_methods, preset_for
from kvsqueeze.methods.spec import PRESET_WINDOW

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, read_records, same_recipe  # noqa: E402

METHODS = "fp16,nuq3-1%,q4.5,q3.5,q2.5,kivi2,turbo3:split,int4"
KVQUANT = "nuq3-1%"  # KVQuant's headline rung: every method is also paired with it on the same questions
# tasks by what their questions ask for
ANSWER_GROUPS = {"one": ("niah_single_number", "niah_single_word", "niah_single_uuid", "niah_multikey"),
                 "several": ("niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")}
RUNS = ["smollm2-135m:out/recipe:4096,8192:many",
        "qwen2.5-coder-0.5b:out/models/qwen2.5-coder-0.5b/recipe:4096,8192,16384,32768:many"]


def parse_run(text: str) -> tuple[str, str, list[int], str]:
    try:
        model, recipe, lengths, layout = text.rsplit(":", 3)
        if layout not in LAYOUTS:
            raise ValueError
        return model, recipe, [int(n) for n in lengths.split(",")], layout
    except ValueError:
        raise SystemExit(f"--run {text!r}: expected MODEL:RECIPE_DIR:LENGTH[,LENGTH...]:LAYOUT with LAYOUT one of "
                         f"{', '.join(LAYOUTS)}") from None


def ratios(scores) -> dict:
    """Each method's average score as a share of fp16's, per model and length."""
    avg = {(s.model, s.method, s.length): s.score for s in scores if s.task == "average"}
    out: dict = {}
    for (model, method, length), score in sorted(avg.items()):
        ref = avg.get((model, "fp16", length))
        if method != "fp16" and ref:
            out.setdefault(model, {}).setdefault(method, {})[str(length)] = round(score / ref, 3)
    return out


def _ci(ci) -> list | None:
    return None if ci is None else list(ci)


def _paired_row(p) -> dict:
    """A `Paired` as the JSON gives it (length 0: every length pooled)."""
    return {"model": p.model, "method": p.method, "length": p.length or "all", "questions": p.questions,
            "score": p.score, "reference_score": p.reference_score, "diff": p.diff, "ci95": _ci(p.ci95),
            "contexts": p.contexts, "samples": p.samples}


def one_haystack(answers, path: Path) -> None:
    """Refuse answers of one question slot (model, length, sample, task, item) made over more than one context
    (another haystack, seed, layout or task set logged to the same file): a sample's questions are paired and
    clustered together, and two haystacks in one sample would be counted as one."""
    seen: dict = {}
    for a in answers:
        slot = (a.model, a.length, a.sample, a.task, a.item)
        first = seen.setdefault(slot, a.context)
        if first != a.context:
            raise SystemExit(f"{path}: {a.model} at {a.length} tokens, sample {a.sample}, {a.task} #{a.item} was "
                             f"answered over two contexts ({first or 'no digest'} and {a.context or 'no digest'}): "
                             "answers of another haystack, layout or task set share the file. Summarize each run "
                             "from an --answers file of its own")


def one_method_each(answers, path: Path) -> None:
    """Refuse a method label whose answers at one length came from two methods (a preset resolved otherwise),
    or from two recipes, or a model answered in two dtypes: they would be one cell's answers under one name.
    Answers of older logs name none of them and pass."""
    seen: dict = {}
    for a in answers:
        for field, cell in (("spec", (a.model, a.method, a.length)), ("recipe", (a.model, a.method, a.length)),
                            ("dtype", (a.model,))):
            value = getattr(a, field)
            if value and seen.setdefault((field, cell), value) != value:
                raise SystemExit(f"{path}: {' '.join(map(str, cell))} holds answers of two {field}s "
                                 f"({seen[(field, cell)]} and {value}): they would count as one cell. Summarize "
                                 "each from an --answers file of its own")


def comparable(answers):
    """The answers every table compares, and what was left out.

    A question enters once every method run on its model at its length has answered it, and a (model, length,
    sample) enters once every such method has finished it: none of its questions waits for a method, and it asks
    every task the length's other samples ask (a sample whose second context no method has started would
    otherwise enter with fewer tasks than its row claims). Returns (kept, answers pending, [model, length, sample]
    of the samples left out, [model, length, method] of the methods run on the model but not at that length)."""
    run_at: dict = {}
    answered_by: dict = {}
    for a in answers:
        run_at.setdefault((a.model, a.length), set()).add(a.method)
        answered_by.setdefault(a.question, set()).add(a.method)
    complete = [a for a in answers if answered_by[a.question] == run_at[(a.model, a.length)]]
    pending = len(answers) - len(complete)
    waiting = {(a.model, a.length, a.sample) for a in answers
               if answered_by[a.question] != run_at[(a.model, a.length)]}
    tasks_at: dict = {}
    tasks_of: dict = {}
    for a in complete:
        tasks_at.setdefault((a.model, a.length), set()).add(a.task)
        tasks_of.setdefault((a.model, a.length, a.sample), set()).add(a.task)
    short = {k for k, t in tasks_of.items() if t != tasks_at[k[:2]]}
    partial = sorted(waiting | short)
    kept = [a for a in complete if (a.model, a.length, a.sample) not in waiting | short]
    pending += len(complete) - len(kept)
    by_model: dict = {}
    for (model, _), methods in run_at.items():
        by_model.setdefault(model, set()).update(methods)
    missing = sorted([model, length, m] for (model, length), methods in run_at.items()
                     for m in by_model[model] - methods)
    return kept, pending, [list(p) for p in partial], missing


def summary_runs(answers, runs, json_path: Path) -> list[dict]:
    """The (model, recipe, lengths, layout) of every model the answers hold, in the order of `runs` and then of
    the file's earlier JSON: a run given only some models (`--run`) still summarizes the others' answers, so their
    tables stay in the JSON the reports are built from."""
    lengths: dict = {}
    for a in answers:
        lengths.setdefault(a.model, set()).add(a.length)
    known = {m: {"model": m, "recipe": r, "layout": lay} for m, r, _, lay in runs}
    if json_path.exists():
        try:
            earlier = json.loads(json_path.read_text()).get("config", {}).get("runs", [])
        except ValueError:
            earlier = []
        for r in earlier:
            known.setdefault(r.get("model"), {k: r.get(k) for k in ("model", "recipe", "layout")})
    order = [m for m in known if m in lengths] + sorted(m for m in lengths if m not in known)
    return [{"model": m, "recipe": known.get(m, {}).get("recipe"), "lengths": sorted(lengths[m]),
             "layout": known.get(m, {}).get("layout")} for m in order]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", help="MODEL:RECIPE_DIR:LENGTHS (repeatable; default: both models)")
    ap.add_argument("--methods", default=METHODS)
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine", default="dense-prefill")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens)")
    ap.add_argument("--rows", type=int, default=24, help="questions answered together, at most")
    ap.add_argument("--row-gb", type=float, default=4.0, help="memory for the cache copies of a batch (GB)")
    ap.add_argument("--prefills", default="out/ruler-prefills",
                    help="where each context's prefill waits until every method has answered it ('' for nowhere)")
    ap.add_argument("--answers", default="benchmarks/results/ruler_answers.jsonl")
    ap.add_argument("--json", default="benchmarks/results/ruler.json")
    ap.add_argument("--plot", default="benchmarks/results/ruler.png")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (on a GPU: the Triton kernels decode)")
    ap.add_argument("--dtype", default="float32", help="float32 (CPU) or bfloat16 (GPU)")
    ap.add_argument("--summarize-only", action="store_true")
    args = ap.parse_args()

    if args.rows < 1 or args.row_gb <= 0:
        ap.error(f"--rows must be at least 1 and --row-gb positive, got {args.rows} and {args.row_gb}")
    unknown = [t for t in args.tasks.split(",") if t not in TASKS]
    if unknown or args.samples < 1:  # before any model loads, and before a summary of no task's answers
        ap.error(f"--tasks must name tasks of {', '.join(TASKS)} (unknown: {', '.join(unknown) or 'none'}) and "
                 f"--samples be at least 1 (got {args.samples})")
    runs = [parse_run(r) for r in (args.run or RUNS)]
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    def specs_at(length: int, windows=()):
        """The methods at one length: presets chosen for it and for the model's layer windows (`windows`; before a
        model loads, layers that hold every token), two names that come to one method there refused, and
        {spec name: preset name} to log them under."""
        specs = parse_methods(",".join(names), context=length, layer_windows=windows)
        return specs, {s.name: n.lower() for s, n in zip(specs, names) if n.lower() in PRESETS}

    for _, _, lengths, _ in runs:  # refused before any model loads
        for n in lengths:
            specs_at(n)
    here = machine() if args.device == "cpu" else f"{args.device}, {machine()}"
    tasks = args.tasks.split(",")
    answers_path = Path(args.answers)
    timing_path = answers_path.with_name(answers_path.stem + "_timing.jsonl")
    try:
        log = AnswerLog(answers_path, repair=not args.summarize_only)  # a summary beside a run only reads
    except ValueError as exc:  # a bad row: its line and the fix
        raise SystemExit(f"ruler.py: {exc}") from None
    if not args.summarize_only:
        from kvsqueeze.integrations.loading import load_model
        from kvsqueeze.recipe import Recipe

        haystack = load_text("bbc").evaluation
        earlier = read_records(timing_path)
        recipes = {}
        for model_name, recipe_dir, _, _ in runs:  # every recipe checked before any model is loaded
            recipes[model_name] = Recipe.load(recipe_dir)
            same_recipe(recipe_dir, recipes[model_name].meta.get("tensors_sha256"),
                        [*(r.get("recipe_sha256") for r in earlier if r.get("model") == model_name),
                         *(a.recipe for a in log.answers if a.model == model_name)],
                        f"the answers in {answers_path} were made with (named in it or in {timing_path.name})",
                        "Run with that recipe, or with --answers of a new file for this one "
                        "(experiments/ruler_recipe_check.py tells whether a recipe calibrated again answers as the "
                        "logged one did)", f"{model_name}: ")
            other = sorted({a.dtype for a in log.answers if a.model == model_name and a.dtype} - {args.dtype})
            if other:
                raise SystemExit(f"{model_name}: the answers in {answers_path} were made in {', '.join(other)}, this "
                                 f"run would answer in {args.dtype}: run in that dtype, or with --answers of a new "
                                 "file")
        loaded = {}
        for model_name, recipe_dir, lengths, layout in runs:
            model, tok = load_model(model_name, args.dtype, args.device)
            contexts = {n: build_contexts(tok, haystack, n, args.samples, seed=args.seed, tasks=tasks, layout=layout)
                        for n in lengths}
            # a preset's fp16 window follows the tokens the model's layers hold
            loaded[model_name] = (model, tok, recipes[model_name], contexts, model_windows(model))
        for sample in range(args.samples):
            for model_name, _, lengths, _ in runs:
                model, tok, recipe, contexts, windows = loaded[model_name]
                for n in lengths:
                    mine = [c for c in contexts[n] if c.sample == sample]
                    t0 = time.perf_counter()
                    before = len(log.answers)
                    specs, labels = specs_at(n, windows)
                    ruler_eval(model, tok, specs, mine, recipe, engine=args.engine, chunk=args.chunk,
                               model_name=model_name, log=log, labels=labels, max_rows=args.rows,
                               row_memory=int(args.row_gb * 2**30), prefill_store=args.prefills or None)
                    if len(log.answers) > before:
                        with timing_path.open("a") as f:
                            f.write(json.dumps({"model": model_name, "length": n, "sample": sample,
                                                "answers": len(log.answers) - before,
                                                "seconds": round(time.perf_counter() - t0, 1),
                                                "machine": here,
                                                "recipe_sha256": recipe.meta.get("tensors_sha256")}) + "\n")
                    print(format_ruler_table(summarize([a for a in log.answers if a.model == model_name])),
                          flush=True)

    shown = [n.lower() if n.lower() in PRESETS else preset_for(n, 2048, ()).name for n in names]
    kept = [a for a in log.answers if a.method in shown and a.engine == args.engine and a.task in tasks]
    one_haystack(kept, answers_path)
    one_method_each(kept, answers_path)
    kept, pending, partial, missing = comparable(kept)
    scores = summarize(kept)
    quantized = [a for a in kept if a.method != "fp16"]
    timing = read_records(timing_path, repair=not args.summarize_only)
    cost: dict = {}
    for t in timing:
        c = cost.setdefault(t["model"], {}).setdefault(str(t["length"]), {"seconds": 0.0, "answers": 0})
        c["seconds"] = round(c["seconds"] + t["seconds"], 1)
        c["answers"] += t["answers"]
        c.setdefault("machines", [])
        if t.get("machine", "not recorded") not in c["machines"]:
            c["machines"].append(t.get("machine", "not recorded"))
    result = {
        "config": {
            # the machines the timing records name (answers of runs that named none: "not recorded")
            "machine": "; ".join(sorted({t.get("machine", "not recorded") for t in timing})) or here,
            "dtype": args.dtype,
            "engine": args.engine, "chunk": args.chunk, "methods": shown,
            "presets": {p: f"{PRESETS[p]}:ctxN at each length N, with an fp16 window (:rW) of 1/64 of the fewest "
                           f"tokens a layer of the model holds, at most {PRESET_WINDOW} (`preset_window`)"
                        for p in shown if p in PRESETS},
            "tasks": tasks, "seed": args.seed, "samples_requested": args.samples,
            "runs": summary_runs(kept, runs, Path(args.json)),
            "haystack": "BBC corpus, evaluation part (articles held out from calibration)",
            "scoring": "share of the expected strings in the greedy answer (RULER's string_match_all), x100; "
                       "average = mean over samples of each sample's mean over tasks, ci95 over samples (Student's t "
                       "on their spread); paired: the same over samples (a sample's contexts together), "
                       "see the module docstring",
            "questions": "those every method run on the model at that length has answered, of samples every such "
                         "method has finished",
            "answers_pending": pending,  # answers to questions some method has not answered yet: left out
            "samples_partial": partial,  # (model, length, sample) some method has not finished: left out whole
            "missing": missing,  # methods asked for that have no answer at a length of a model: not in its tables
        },
        # an average over fewer tasks than asked (a run stopped inside a length) says how many it covers
        "rows": [{"model": s.model, "method": s.method, "task": s.task, "length": s.length, "samples": s.samples,
                  "score": s.score, **({"ci95": list(s.ci95)} if s.ci95 else {})} for s in scores],
        "share_of_fp16": ratios(scores),
        # the same questions answered by each method and by fp16: mean difference in points, 95% interval over
        # samples, share of fp16's mean score
        "paired": [{"model": p.model, "method": p.method, "length": p.length, "questions": p.questions,
                    "score": p.score, "fp16_score": p.reference_score, "diff": p.diff, "ci95": _ci(p.ci95),
                    "share": p.share, "on_fp16_right": p.on_reference_right, "fp16_right": p.reference_right,
                    "contexts": p.contexts, "samples": p.samples}
                   for p in paired(kept)],
        # the same, split by what a question asks for: one string, or several (where a method's loss on Qwen's
        # first 4K context lay)
        "paired_by_answers": [{"answers": group, "model": p.model, "method": p.method, "length": p.length,
                               "questions": p.questions, "score": p.score, "fp16_score": p.reference_score,
                               "diff": p.diff, "ci95": _ci(p.ci95), "on_fp16_right": p.on_reference_right,
                               "fp16_right": p.reference_right, "contexts": p.contexts, "samples": p.samples}
                              for group, members in ANSWER_GROUPS.items()
                              for p in paired([a for a in kept if a.task in members])],
        # every length's questions pooled, against fp16; and each method against KVQuant's `nuq3-1%` on the same
        # questions, per length and pooled: the comparison that made `q3.5` the default
        "paired_all_lengths": [_paired_row(p) for p in paired(kept, by_length=False)],
        "against_kvquant": [_paired_row(p) for p in paired(quantized, KVQUANT) + paired(quantized, KVQUANT,
                                                                                        by_length=False)],
        "cost": cost,
        "answers": str(answers_path),
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if scores:
        plot_ruler(scores, args.plot)
    for model_name, *_ in runs:
        print(format_ruler_table([s for s in scores if s.model == model_name]))
    print(f"wrote {args.json} and {args.plot}")


if __name__ == "__main__":
    main()
