"""Render the benchmark JSON files in benchmarks/results/ as the Markdown tables of README.md and docs/results.md.

Each table stands in those files between `<!-- report:NAME -->` and `<!-- /report:NAME -->`; this script
rewrites what is between the markers from the JSON and leaves the prose around them alone.

    python benchmarks/report.py            # rewrite the tables of README.md and docs/results.md
    python benchmarks/report.py --check    # exit 1 when a table differs from what the JSON gives
    python benchmarks/report.py --print    # print every table
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from kvsqueeze.config import EvalConfig

sys.path.insert(0, str(Path(__file__).parent))
from common import models_table, peers_table, window_note  # noqa: E402  (the tables models.py and peers.py print)

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = (ROOT / "README.md", ROOT / "docs" / "results.md")
HEADLINE = tuple(EvalConfig().methods.split(","))  # the methods `make demo` evaluates
BUDGET_ROWS = ("fp16", "nuq2-1%", "nuq@2.5", "nuq@2.5:chan", "nuq@2.5:kl:chan", "nuq@2.6", "nuq@2.6:kl",
               "nuq@2.6:chan", "nuq@2.6:kl:chan", "nuq@3", "nuq@3:chan", "nuq3-1%", "nuq@3.5", "nuq@3.5:kl",
               "nuq@3.45:chan", "nuq@3.49:chan", "nuq@3.49:kl:chan", "nuq@3.5:chan", "nuq@3.5:kl:chan",
               "nuq3-1%:sink16", "nuq@4:chan", "nuq4-1%", "nuq@4.5", "nuq@4.5:kl", "nuq@4.5:chan", "nuq@4.5:kl:chan",
               "nuq@4.58:chan", "nuq@4.58:kl:chan", "nuq@4.6:chan", "nuq@2.5:r32:chan", "nuq@2.6:r32:chan",
               "nuq@3.49:r32:chan", "nuq@3.5:r32:chan", "nuq@4.58:r32:chan")


def _load(d: Path, name: str) -> dict | None:
    p = d / name
    return json.loads(p.read_text()) if p.exists() else None


def describe(name: str) -> str:
    """A short description of a method from its name (the registry's)."""
    from kvsqueeze.methods import describe as registry_describe, parse_method

    return registry_describe(parse_method(name))


def ladder(data: dict, methods: tuple[str, ...] | None = None) -> str:
    base = next(r["ppl"] for r in data["rows"] if r["method"] == "fp16")
    full = "ci95" in data["rows"][0]
    head = "| method | what | avg bits | PPL | vs fp16 |" + (" 95% CI | KLD | top-1 |" if full else "")
    out = [f"{data['model']}, {data['text']}, {window_note(data)} ({data.get('machine', 'x86_64, 2 cores')})\n",
           head, "|---|---|---:|---:|---:|" + ("---:|---:|---:|" if full else "")]
    rows = data["rows"]
    if methods is not None:
        at = {r["method"]: r for r in rows}
        rows = [at[m] for m in methods if m in at]
    for r in rows:
        step = r.get("step", "") if methods is None else ""  # a selection describes each method on its own
        what = step if step and not step.endswith("-bit") else describe(r["method"])
        change = (r["ppl"] / base - 1) * 100
        line = f"| `{r['method']}` | {what} | {r['avg_bits']:.2f} | {r['ppl']:.3f} | {change:+.2f}% |"
        if full:
            ci = f"{r['ci95'][0]:+.2f} … {r['ci95'][1]:+.2f}" if r.get("ci95") else "–"
            line += f" {ci} | {r['kld_mean']:.4f} | {100 * r['top1']:.1f}% |"
        out.append(line)
    return "\n".join(out)


def memory(data: dict) -> str:
    """Stored bits per K/V element by context length: measured rows are a real cache's memory report (equal to the
    registry's count), the others the registry's count (nominal outliers)."""
    lengths = sorted({r["tokens"] for r in data["rows"]})
    cells: dict[tuple, dict] = {}
    for r in data["rows"]:
        cells.setdefault((r["model"], r["method"]), {})[r["tokens"]] = r
    out = [f"{data['model']} and a 7B shape, {data['text']}; a real cache filled from one {data['forward_tokens']:,}-token "
           f"forward where measured ({data['machine']})\n",
           "| model | cache | " + " | ".join(f"bits at {n:,}" for n in lengths) + " | counted from |",
           "|---|---|" + "---:|" * len(lengths) + "---|"]
    for (model, method), by_len in cells.items():
        bits = " | ".join(f"{by_len[n]['avg_bits']:.3f}" if n in by_len else "" for n in lengths)
        how = ", ".join(dict.fromkeys(f"{by_len[n]['source']}" for n in lengths if n in by_len))
        out.append(f"| {model} | `{method}` | {bits} | {how} |")
    return "\n".join(out)


def longctx(data: dict) -> str:
    out = []
    rows = data["ppl_by_length"]
    lengths = sorted({r["seqlen"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    ppl = {(r["method"], r["seqlen"]): r for r in rows}
    base = {n: ppl[("fp16", n)]["ppl"] for n in lengths if ("fp16", n) in ppl}
    out.append(f"Perplexity against context length ({data['model']}, {data['text']}; "
               + ", ".join(f"{n}: {ppl[(methods[0], n)]['windows']} windows" for n in lengths) + ")\n")
    out.append("| method | " + " | ".join(str(n) for n in lengths) + " |")
    out.append("|---|" + "---:|" * len(lengths))
    for m in methods:
        cells = []
        for n in lengths:
            r = ppl.get((m, n))
            cells.append("-" if r is None else f"{r['ppl']:.3f}" + (f" ({(r['ppl'] / base[n] - 1) * 100:+.1f}%)"
                                                                    if m != "fp16" and n in base else ""))
        out.append(f"| `{m}` | " + " | ".join(cells) + " |")
    if data.get("passkey"):
        pk = data["passkey"]
        lengths = sorted({r["length"] for r in pk})
        acc = {(r["method"], r["length"]): r for r in pk}
        trials = sorted({r["trials"] for r in pk})
        out.append(f"\nPasskey retrieval, exact match ({'/'.join(map(str, trials))} trials per cell, "
                   "the same seeded prompts for every method)\n")
        out.append("| method | " + " | ".join(str(n) for n in lengths) + " |")
        out.append("|---|" + "---:|" * len(lengths))
        for m in dict.fromkeys(r["method"] for r in pk):
            out.append(f"| `{m}` | " + " | ".join(
                f"{acc[(m, n)]['accuracy']:.2f}" if (m, n) in acc else "-" for n in lengths) + " |")
    return "\n".join(out)


def decode(data: dict) -> str:
    rows = data["rows"]
    contexts = sorted({r["context"] for r in rows})
    keys = list(dict.fromkeys((r["method"], r["backend"]) for r in rows))
    ms = {(r["method"], r["backend"], r["context"]): r["median_ms"] for r in rows}
    out = ["| method | backend | " + " | ".join(f"{c // 1024}K" for c in contexts) + " |",
           "|---|---|" + "---:|" * len(contexts)]
    for m, b in keys:
        out.append(f"| `{m}` | {b} | " + " | ".join(
            f"{ms[(m, b, c)]:.2f}" if (m, b, c) in ms else "-" for c in contexts) + " |")
    dense = {c: ms.get(("dense-float32", "torch-sdpa", c)) for c in contexts}
    fused = [(m, b) for m, b in keys if b == "numba"]
    if fused and any(dense.values()):
        n = data.get("machine", {}).get("threads", "?")
        out += ["", f"Dense fp32 SDPA time over fused time, same run ({n} thread{'' if n == 1 else 's'}):", "",
                "| method | " + " | ".join(f"{c // 1024}K" for c in contexts) + " |", "|---|" + "---:|" * len(contexts)]
        for m, b in fused:
            out.append(f"| `{m}` | " + " | ".join(
                f"{dense[c] / ms[(m, b, c)]:.2f}×" if dense[c] and (m, b, c) in ms else "-" for c in contexts) + " |")
    if data.get("e2e"):
        out += ["", "| cache | prompt | new tokens | prefill s | decode tokens/s | tokens equal to DynamicCache |",
                "|---|---:|---:|---:|---:|---:|"]
        for r in data["e2e"]:
            out.append(f"| {r['cache']} | {r['prompt_tokens']} | {r['new_tokens']} | {r['prefill_s']:.1f} | "
                       f"{r['decode_tokens_per_s']:.2f} | {r['tokens_equal_to_dynamic_cache']} |")
    return "\n".join(out)


def decode_passes(data: dict) -> str:
    rows = data["rows"]
    names = list(dict.fromkeys(k for r in rows for k in r["median_ms"]))
    m0 = data.get("machine", {})
    out = [f"ms per call at {rows[0]['context']} tokens, {m0.get('threads', '?')} threads, {data.get('timing', '')}",
           "", "| method | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for r in rows:
        out.append(f"| `{r['method']}` | " + " | ".join(
            f"{r['median_ms'][n]:.3f}" if n in r["median_ms"] else "-" for n in names) + " |")
    return "\n".join(out)


def decode_ratios(data: dict) -> str:
    """Dense fp32 SDPA time over fused time per method and context (the headline of a decode run)."""
    table = decode(data).split("\n")
    start = next(i for i, line in enumerate(table) if line.startswith("Dense fp32 SDPA time over fused time"))
    end = next((i for i in range(start + 3, len(table)) if not table[i].startswith("|")), len(table))
    return "\n".join(table[start + 2: end])


def e2e(data: dict) -> str:
    table = decode(data).split("\n")
    start = next(i for i, line in enumerate(table) if line.startswith("| cache | prompt"))
    return "\n".join(table[start:])


def demo(data: dict) -> str:
    """One line: what `make demo` printed on another machine, as changes against its own fp16."""
    base = next(r["ppl"] for r in data["rows"] if r["method"] == "fp16")
    cells = [f"`{r['method']}` {(r['ppl'] / base - 1) * 100:+.2f}%" for r in data["rows"] if r["method"] != "fp16"]
    return (f"`make demo` on {data['machine']} (its own recipe, the same windows): fp16 {base:.3f}; "
            + ", ".join(cells) + ".")


def budget_models(data: dict) -> str:
    """Each model's bit budget against plain nuq at the bits the plain method stores (`benchmarks/budget.py`)."""
    out = [f"BBC evaluation part, {data['models'][0]['windows']} spread windows of 2048 tokens, each model's own "
           f"recipe ({data['machine']})\n",
           "| model | method | what | bits | vs fp16 | 95% CI | KLD | vs plain | 95% CI |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    from kvsqueeze.methods import parse_method

    def kind(name: str) -> str:
        spec = parse_method(name)
        if spec.budget is None:
            return "plain"
        unit = "width per channel" if spec.budget_unit == "channel" else "width per layer"
        return (unit + (", measured scales" if spec.budget_proxy == "kl" else "")
                + (f", {spec.window} recent tokens fp16" if spec.window else ""))

    for m in data["models"]:
        at = {r["method"]: r for r in m["rows"]}
        for names in m["pairs"]:
            for name in names:
                r = at[name]
                ci = f"{r['ci95'][0]:+.2f} … {r['ci95'][1]:+.2f}"
                vs = r.get("vs_plain")
                against = (f"{vs['change_pct']:+.2f}% | {vs['ci95'][0]:+.2f} … {vs['ci95'][1]:+.2f}"
                           if vs and vs.get("ci95") else "– | –")
                out.append(f"| `{m['model']}` | `{name}` | {kind(name)} | {r['avg_bits']:.2f} | {r['change_pct']:+.2f}% | "
                           f"{ci} | {r['kld_mean']:.4f} | {against} |")
    if data.get("decode"):
        d = {r["method"]: r for r in data["decode"]}
        out.append(f"\nOne fused decode step over all {data['decode'][0]['layers']} layers at "
                   f"{data['decode'][0]['context']} tokens (numba): " + ", ".join(
                       f"`{k}` {v['median_ms']:.1f} ms" for k, v in d.items()))
    return "\n".join(out)


def ruler(data: dict, task: str = "average") -> str:
    """The RULER-style suite (`benchmarks/ruler.py`): each method's average score per model and length, with its
    share of fp16's and the samples behind it."""
    cfg = data["config"]
    rows = [r for r in data["rows"] if r["task"] == task]
    out = [f"{', '.join(cfg['tasks'])}; {cfg['engine']} engine, greedy answers ({cfg['machine']})\n"]
    for run in cfg["runs"]:
        mine = [r for r in rows if r["model"] == run["model"]]
        if not mine:
            continue
        lengths = sorted({r["length"] for r in mine})
        cell = {(r["method"], r["length"]): r for r in mine}
        samples = sorted({r["samples"] for r in mine})
        out += [f"`{run['model']}` ({run['layout']} layout, {'/'.join(map(str, samples))} sample(s) per length):\n",
                "| method | " + " | ".join(f"{n // 1024}K" for n in lengths) + " |",
                "|---|" + "---:|" * len(lengths)]
        for m in cfg["methods"]:
            cells = []
            for n in lengths:
                r, ref = cell.get((m, n)), cell.get(("fp16", n))
                cells.append(_score_cell(r, ref, m))
            out.append(f"| `{m}` | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out).rstrip()


def ruler_paired(data: dict) -> str:
    """Each method against fp16 on the same questions: the mean difference in points and its 95% interval."""
    cfg = data["config"]
    out = ["Score difference against fp16 on the same questions, in points (the intervals its JSON holds: a 95% "
           "bootstrap over questions as this run was first summarised, which takes the questions of one prefill as "
           "independent and overstates the precision; summarised again, one sample gives none; the run with many "
           "questions per context, below, gives intervals over samples)\n"]
    for run in cfg["runs"]:
        mine = [r for r in data.get("paired", []) if r["model"] == run["model"]]
        if not mine:
            continue
        lengths = sorted({r["length"] for r in mine})
        cell = {(r["method"], r["length"]): r for r in mine}
        out += [f"`{run['model']}`:\n", "| method | " + " | ".join(f"{n // 1024}K" for n in lengths) + " |",
                "|---|" + "---:|" * len(lengths)]
        for m in cfg["methods"]:
            if m == "fp16":
                continue
            cells = [f"{_points(c)}, n={c['questions']}" if (c := cell.get((m, n))) else "–" for n in lengths]
            out.append(f"| `{m}` | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out).rstrip()


def ruler_questions(data: dict) -> str:
    """`ruler.json` (layout many): per model and length, each method against fp16 on the same questions: the
    difference in points with its interval, the share of fp16's score, the score on the questions fp16 answers
    fully, and the difference on questions asking for one string and for several."""
    cfg = data["config"]
    paired = {(r["model"], r["method"], r["length"]): r for r in data.get("paired", [])}
    split = {(r["model"], r["method"], r["length"], r["answers"]): r for r in data.get("paired_by_answers", [])}
    out = [f"Points against fp16 on the same questions ({OVER_SAMPLES}); {cfg['engine']} engine, greedy answers "
           f"({cfg['machine']})\n"]
    for run in cfg["runs"]:
        lengths = sorted({n for m, _, n in paired if m == run["model"]})
        for n in lengths:
            ref = next((r for (m, _, k), r in paired.items() if m == run["model"] and k == n), None)
            out += [f"`{run['model']}` at {n // 1024}K (fp16 scores {ref['fp16_score']:.1f}; answers fully "
                    f"{ref['fp16_right']} of {ref['questions']} questions, asked on {_drawn(ref)}):\n",
                    "| method | questions | score | vs fp16 | share | on fp16's right | one answer | several |",
                    "|---|---:|---:|---:|---:|---:|---:|---:|"]
            for meth in cfg["methods"]:
                r = paired.get((run["model"], meth, n))
                if r is None:
                    continue
                one, several = (split.get((run["model"], meth, n, g)) for g in ("one", "several"))
                share = "–" if r["share"] is None else f"{100 * r['share']:.0f}%"
                right = "–" if r["on_fp16_right"] is None else f"{r['on_fp16_right']:.1f}"
                out.append(f"| `{meth}` | {r['questions']} | {r['score']:.1f} | {_points(r)} | {share} | {right} | "
                           + " | ".join("–" if g is None else f"{_signed(g['diff'], 1)} (n={g['questions']})"
                                        for g in (one, several)) + " |")
            out.append("")
    return "\n".join(out).rstrip()


def ruler_pooled(data: dict) -> str:
    """`ruler.json`: each method against fp16 on every length's questions pooled, and against KVQuant's
    `nuq3-1%` on the same questions, per length and pooled (points, 95% interval over samples)."""
    cfg = data["config"]
    pooled = {(r["model"], r["method"]): r for r in data.get("paired_all_lengths", [])}
    head = {(r["model"], r["method"], r["length"]): r for r in data.get("against_kvquant", [])}

    def cell(r: dict | None) -> str:
        return "–" if r is None else _points(r)

    out = []
    for run in cfg["runs"]:
        lengths = sorted({n for m, _, n in head if m == run["model"] and n != "all"})
        if not lengths:
            continue
        out += [f"`{run['model']}`, every length pooled against fp16, and against `nuq3-1%` on the same questions "
                f"({OVER_SAMPLES}):\n",
                "| method | questions | vs fp16, all lengths | "
                + " | ".join(f"vs `nuq3-1%` {n // 1024}K" for n in lengths) + " | vs `nuq3-1%`, all |",
                "|---|---:|---:|" + "---:|" * (len(lengths) + 1)]
        for meth in cfg["methods"]:
            r = pooled.get((run["model"], meth))
            if r is None:
                continue
            row = [cell(head.get((run["model"], meth, n))) for n in [*lengths, "all"]]  # none for nuq3-1% itself
            out.append(f"| `{meth}` | {r['questions']} | {cell(r)} | " + " | ".join(row) + " |")
        out.append("")
    return "\n".join(out).rstrip()


def ruler_compact(data: dict) -> str:
    """One table for the README: the average score of each method at every (model, length), share of fp16's."""
    cfg = data["config"]
    rows = {(r["model"], r["method"], r["length"]): r for r in data["rows"] if r["task"] == "average"}
    cols = sorted({(m, n) for m, _, n in rows}, key=lambda c: ([r["model"] for r in cfg["runs"]].index(c[0]), c[1]))
    short = {r["model"]: r["model"].split("-")[0] for r in cfg["runs"]}
    samples = sorted({r["samples"] for r in rows.values()})
    out = [f"Average score over {len(cfg['tasks'])} tasks (0-100; in brackets: share of fp16), "
           f"{'/'.join(map(str, samples))} sample(s) per cell, {cfg['engine']} engine ({cfg['machine']})\n",
           "| method | " + " | ".join(f"{short[m]} {n // 1024}K" for m, n in cols) + " |",
           "|---|" + "---:|" * len(cols)]
    for meth in cfg["methods"]:
        cells = []
        for m, n in cols:
            r, ref = rows.get((m, meth, n)), rows.get((m, "fp16", n))
            cells.append(_score_cell(r, ref, meth))
        out.append(f"| `{meth}` | " + " | ".join(cells) + " |")
    if any("tasks" in r for r in rows.values()):
        out.append(f"\n† the average of the tasks measured so far (of {len(cfg['tasks'])}): the run stopped inside "
                   "that length; it resumes from its answers file.")
    return "\n".join(out)


def _score_cell(row: dict | None, ref: dict | None, method: str) -> str:
    """A score, its share of fp16's, and † with the task count where the average covers fewer tasks than asked."""
    if row is None:
        return "–"
    partial = f" †{row['tasks']}" if "tasks" in row else ""
    if method == "fp16" or not ref or not ref["score"]:
        return f"{row['score']:.1f}{partial}"
    return f"{row['score']:.1f} ({100 * row['score'] / ref['score']:.0f}%){partial}"


def _served(data: dict, chunk: bool = True, th: dict | None = None) -> str:
    """What the capacity and speed rows served, where it is not the method of the token rows, and the prefill chunk
    of kvsqueeze's run the speed row `th` counts."""
    th = th or data["throughput"]
    served = data.get("throughput_method")
    if not served or served == data["method"]:
        return ""
    tokens = th.get("max_num_batched_tokens", {}).get(th.get("kvsqueeze_engine", "kvsqueeze")) if chunk else None
    size = "" if not tokens else (f", {tokens} prefill chunk" if isinstance(tokens, str) else
                                  f", prefill chunks of {tokens} tokens")
    return f"; `{served}`" + size + (
        f", on {th['machine']}" if th.get("machine") and th["machine"] != data["machine"] else "")


def vllm(data: dict) -> str:
    """kvsqueeze's backend inside vLLM's engine: tokens against the HF path, capacity, throughput, serve."""
    cap, th = data["capacity"], data["throughput"]
    rows = [
        f"{data['model']}, `{data['method']}`, {data['engine']} ({data['machine']})",
        "",
        "| measurement | kvsqueeze in vLLM | vLLM's own cache | |",
        "|---|---:|---:|---|",
        f"| greedy tokens equal to kvsqueeze's HF path, given its prefix | {data['tokens_equal_to_hf']} of "
        f"{data['tokens_compared']} | – | {data['tokens']['prompts']} prompts of {data['tokens']['prompt_tokens']} "
        f"tokens, {data['tokens']['new_tokens']} new each, float32 |",
        f"| the same, both generating on their own | {data['tokens_equal_free_running']} of "
        f"{data['tokens_compared']} | – | position by position: after a first difference the texts differ |",
        f"| token slots in {cap['kv_bytes'] / 2**30:g} GiB of KV space | {cap['kvsqueeze_tokens']:,} "
        f"| {cap['vllm_tokens']:,} | {cap['kvsqueeze_tokens'] / cap['vllm_tokens']:.2f}x, model in {cap['dtype']}, "
        f"blocks of {cap['block_size']}{_served(data, chunk=False)} |",
        f"| output tokens/s, {th['concurrent']} concurrent requests of {th['prompt_tokens']} tokens | "
        f"{th['kvsqueeze_tokens_per_s']:.2f} | {th['vllm_tokens_per_s']:.2f} | {th['ratio']:.2f}x, "
        f"{th['new_tokens']} new tokens each, prefill included, {th['dtype']}{_served(data)} |",
    ]
    if data.get("throughput_decode"):
        td = data["throughput_decode"]
        rows.append(f"| the same, {td['new_tokens']} new tokens each | {td['kvsqueeze_tokens_per_s']:.2f} | "
                    f"{td['vllm_tokens_per_s']:.2f} | {td['ratio']:.2f}x, decoding most of the time{_served(data, th=td)} |")
    if data.get("serve"):
        sv = data["serve"]
        rows.append(f"| completion from `vllm serve`'s OpenAI server | {sv['request_seconds']:.1f} s | – | "
                    f"\"{sv['prompt']}\" → \"{sv['completion'].strip()[:60]}\" |")
    return "\n".join(rows)


def tensor_parallel(data: dict) -> str:
    """One rank against several through vLLM's engine (`benchmarks/vllm_tp.py`): PPL and its change from fp16,
    page bytes and token slots a rank."""
    tp = data["tensor_parallel"]
    one, many = tp["one_rank"], tp["ranks_run"]
    ci = "" if one["ci95"] is None else f" ({one['ci95'][0]:+.3f} … {one['ci95'][1]:+.3f})"
    return "\n".join([
        f"{tp['model']}, `{tp['method']}` served as `{tp['served_method']}`, {tp['windows']} windows of "
        f"{tp['window_tokens']:,} tokens ({tp['text']}), {tp['dtype']} ({tp['machine']})", "",
        "| ranks | PPL | change from fp16 (HF path) | page bytes per token, a rank | token slots in 1 GiB, a rank |",
        "|---:|---:|---|---:|---:|",
        f"| 1 | {one['ppl']:.4f} | {one['delta_pct']:+.3f}%{ci} | {one['page_bytes_per_token']:,.0f} | "
        f"{one['kv_tokens']:,} |",
        f"| {tp['ranks']} | {many['ppl']:.4f} | {many['delta_pct']:+.3f}% | "
        f"{max(many['page_bytes_per_token_per_rank']):,.0f} | {many['kv_tokens_per_rank']:,} |",
        "", f"Inside one rank's interval: {'yes' if tp['ppl_inside_one_rank_interval'] else 'no'}; paired against "
        f"one rank "
        f"{tp['paired_ci95_against_one_rank'][0]:+.3f} … {tp['paired_ci95_against_one_rank'][1]:+.3f}%; first "
        f"choices agree at {100 * tp['top1_agreement']:.1f}% of {tp['tokens_scored']:,} positions."])


def transfer(data: dict, methods: tuple[str, ...] | None = None) -> str:
    """Each recipe's PPL change against fp16 on every text, with its paired interval; in-domain cells in bold."""
    rows = data["rows"]
    texts = list(dict.fromkeys(r["eval_text"] for r in rows))
    machines = {}  # model -> the machines its cells were measured on
    for key, cell in data.get("cells", {}).items():
        machines.setdefault(key.split("/")[0], set()).add(cell.get("machine") or data["machine"])
    where = "; ".join(f"{m}: {', '.join(sorted(ms))}" for m, ms in machines.items()) or data["machine"]
    out = [f"{data['settings']['windows']} windows of {data['settings']['seqlen']:,} tokens per text; {where}",
           "", "| model | calibrated on | method | bits held | " + " | ".join(texts) + " |",
           "|---|---|---|---:|" + "---:|" * len(texts)]
    keys = list(dict.fromkeys((r["model"], r["calib_text"], r["method"]) for r in rows if r["method"] != "fp16"))
    for model, calib, method in keys:
        if methods is not None and method not in methods:
            continue
        mine = {r["eval_text"]: r for r in rows if (r["model"], r["calib_text"], r["method"]) == (model, calib, method)}
        cells = []
        for t in texts:
            r = mine.get(t)
            if r is None:
                cells.append("–")
                continue
            if "refused" in r:  # the model's cache cannot hold it as named
                cells.append("refused")
                continue
            cell = f"{r['delta_pct']:+.2f}%" + (f" ({r['ci95'][0]:+.2f} … {r['ci95'][1]:+.2f})" if r["ci95"] else "")
            cells.append(f"**{cell}**" if r["in_domain"] else cell)
        held = [r["avg_bits"] for r in mine.values() if "refused" not in r]
        bits = f"{sum(held) / len(held):.2f}" if held else "–"
        out.append(f"| {model} | {calib} | `{method}` | {bits} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def ppl_by_length(data: dict) -> str:
    """PPL change against fp16 at each window length, with the paired interval over blocks of tokens."""
    rows = data["rows"]
    lengths = sorted({r["length"] for r in rows})
    lengths_on = {}  # machine -> the lengths measured on it
    for n in lengths:
        lengths_on.setdefault(data.get("machines", {}).get(str(n), data["machine"]), []).append(f"{n // 1024}K")
    where = "; ".join(f"{m}: {', '.join(ns)}" for m, ns in lengths_on.items())
    measured = ", ".join(f"{n // 1024}K: {max(r['tokens'] for r in rows if r['length'] == n):,}" for n in lengths)
    unchecked = data.get("unchecked_windows")
    out = [f"{data['model']}, {data['text']} evaluation part, windows spread evenly over it (up to "
           f"{data['tokens_per_length']:,} tokens a length; scored so far, {measured}); every method of a length on "
           f"the same windows; {where}"
           + (f". {unchecked} of the window records predate the recipe digest and token ids a run checks now"
              if unchecked else ""), "",
           "| method | " + " | ".join(f"{n // 1024}K" for n in lengths) + " |", "|---|" + "---:|" * len(lengths)]
    for method in dict.fromkeys(r["method"] for r in rows):
        at = {r["length"]: r for r in rows if r["method"] == method}
        cells = []
        for n in lengths:
            r = at.get(n)
            if r is None:
                cells.append("–")
            elif r["ci95"] is None:
                cells.append(f"PPL {r['ppl']:.3f} ({r['windows']} windows)")
            else:
                cells.append(f"{r['delta_pct']:+.2f}% ({r['ci95'][0]:+.2f} … {r['ci95'][1]:+.2f}), "
                             f"{r['avg_bits']:.2f} bits, {r['windows']} windows")
        out.append(f"| `{method}` | " + " | ".join(cells) + " |")
    return "\n".join(out)


# The decode-step runs the README's speed rows cover: the runs of `decode.py --step` on the AMD EPYC, with AVX-512
# and forced to AVX2, whose dense baseline is the grouped SDPA call (`dense_call`, from 2026-12-06; `_step_ratios`
# skips the earlier runs, whose baseline was SDPA with enable_gqa=True and whose preset had no window).
STEP_RUNS = {"avx512": "decode_step_amd_epyc_avx512*.json",
             "forced_avx2": "decode_step_amd_epyc_forced_avx2_run*.json"}
COMPARED = ("q3.5", "nuq3-1%")  # the README's headline pair: the default preset and KVQuant's method


def _signed(x: float, digits: int) -> str:
    """x with its sign (a true minus), and no sign where it rounds to zero."""
    text = f"{x:+.{digits}f}"
    return text[1:] if float(text) == 0 else text.replace("-", "−")


def _pct(delta: float, ci) -> str:
    return f"{_signed(delta, 2)}% ({_signed(ci[0], 2)} … {_signed(ci[1], 2)})"


def _points(r: dict) -> str:
    """A paired RULER difference in points with its interval over samples (none over a single sample)."""
    ci = r.get("ci95")
    return f"{_signed(r['diff'], 1)} " + ("(one sample: no interval)" if ci is None
                                          else f"({_signed(ci[0], 1)} … {_signed(ci[1], 1)})")


def _drawn(r: dict) -> str:
    """What a paired RULER row's questions were asked on: samples (the interval's unit) and contexts."""
    return f"{r['samples']} samples ({r['contexts']} contexts)" if "samples" in r else f"{r['contexts']} contexts"


OVER_SAMPLES = ("95% interval over samples: a sample's contexts share their quantized caches, so their questions "
                "count together; Student's t on the samples' spread")


def _short(model: str) -> str:
    return {"smollm2-135m": "SmolLM2-135M", "qwen2.5-coder-0.5b": "Qwen2.5-Coder-0.5B",
            "gemma3-270m": "Gemma-3-270M"}.get(model, model)


def _step_ratios(results: Path, pattern: str, method: str, n: int) -> tuple[float, float, int]:
    """(min, max, runs) of the step ratio against the static fp32 step, over the runs whose dense baseline is the
    grouped SDPA call (`dense_call`; earlier runs timed SDPA with enable_gqa=True, 1.5-1.8x slower)."""
    runs = [json.loads(f.read_text()) for f in sorted(results.glob(pattern))]
    got = [r["step_ratios"][f"{n}: static-float32 step / fused {method} step"] for r in runs if "dense_call" in r]
    if not got:
        raise SystemExit(f"no decode-step runs {results / pattern}: run `benchmarks/decode.py --step`")
    return min(got), max(got), len(got)


def headline_compare(results: Path) -> str:
    """The README's table of the 3.5-bit preset against `nuq3-1%`: perplexity at 2K to 32K, off the calibration
    text, RULER retrieval and the decode step, each row from the JSON named in it."""
    load = lambda name: json.loads((results / name).read_text())  # noqa: E731
    head, by_len, transfer, ruler = (load(f) for f in ("headline.json", "ppl_by_length.json", "transfer.json",
                                                        "ruler.json"))
    out = ["| measurement | `q3.5` | `nuq3-1%` | JSON |", "|---|---:|---:|---|"]
    rows = {r["method"]: r for r in head["rows"]}
    fp16 = rows["fp16"]["ppl"]
    budget = next(m for m in rows if m.startswith("nuq@3.") and ":r32:" in m)  # the 3.5-bit budget of that run
    cells = [_pct(100 * (rows[m]["ppl"] / fp16 - 1), rows[m]["ci95"]) for m in (budget, "nuq3-1%")]
    out.append(f"| {_short(head['model'])}, PPL at {head['seqlen'] // 1024}K, {head['windows']} "
               f"{head['text'].upper()} windows (the budget at {budget[4:].split(':')[0]} bits, `{budget}`) | "
               + " | ".join(cells) + " | headline.json |")
    at = {(r["method"], r["length"]): r for r in by_len["rows"]}
    for n in sorted({r["length"] for r in by_len["rows"]}):
        pair = [at.get((m, n)) for m in COMPARED]
        if None in pair:
            continue
        counts = sorted({r["windows"] for r in pair})
        windows = "–".join(map(str, counts)) + f" {by_len['text'].upper()} window" + ("" if counts == [1] else "s")
        over = {r.get("ci95_over", "segments") for r in pair if r["ci95"]}  # JSONs before it: over segments
        how = (f" (interval over {by_len['segment'] // 1024}K-token segments of one window)"
               if over & {"segments", "segments of one window"} else "")
        out.append(f"| {_short(by_len['model'])}, PPL at {n // 1024}K, {windows}{how} | "
                   + " | ".join(_pct(r["delta_pct"], r["ci95"]) for r in pair) + " | ppl_by_length.json |")
    worst = {(r["model"], r["method"]): r for r in transfer["summary"] if r["calib_text"] == "bbc"}
    models = list(dict.fromkeys(r["model"] for r in transfer["summary"] if r["calib_text"] == "bbc"))
    models.sort(key=["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"].index)
    texts = {worst[(m, COMPARED[0])]["texts"] for m in models}
    out.append(f"| worst PPL of {'/'.join(map(str, texts))} kinds of text, calibrated on BBC: "
               + " / ".join(map(_short, models)) + " | "
               + " | ".join(" / ".join(_signed(worst[(m, meth)]["worst_delta_pct"], 2) + "%" for m in models)
                            for meth in COMPARED) + " | transfer.json |")
    cell = {(r["model"], r["calib_text"], r["eval_text"], r["method"]): r for r in transfer["rows"]}
    for m in models:
        if m == "smollm2-135m":  # its in-domain row is the headline run's, above
            continue
        pair = [cell[(m, "bbc", "bbc", meth)] for meth in COMPARED]
        out.append(f"| {_short(m)}, PPL at {transfer['settings']['seqlen'] // 1024}K, {pair[0]['windows']} BBC "
                   "windows, calibrated on BBC (transfer run) | "
                   + " | ".join(_pct(r["delta_pct"], r["ci95"]) for r in pair) + " | transfer.json |")
    paired = {(r["model"], r["method"], r["length"]): r for r in ruler["paired"]}
    for run in ruler["config"]["runs"]:
        m = run["model"]
        for n in sorted({k[2] for k in paired if k[0] == m}):
            pair = [paired.get((m, meth, n)) for meth in COMPARED]
            if None in pair:
                continue
            out.append(f"| {_short(m)}, RULER {n // 1024}K, points from fp16 ({pair[0]['fp16_score']:.1f}), "
                       f"{pair[0]['questions']} paired questions on {_drawn(pair[0])} | "
                       + " | ".join(map(_points, pair))
                       + " | ruler.json |")
        pooled = {r["method"]: r for r in ruler.get("paired_all_lengths", []) if r["model"] == m}
        if all(meth in pooled for meth in COMPARED):
            lengths = sorted({k[2] for k in paired if k[0] == m})
            span = f"{lengths[0] // 1024}K–{lengths[-1] // 1024}K"
            out.append(f"| {_short(m)}, RULER {span} pooled, points from fp16, {pooled[COMPARED[0]]['questions']} "
                       f"paired questions on {_drawn(pooled[COMPARED[0]])} | "
                       + " | ".join(_points(pooled[meth]) for meth in COMPARED)
                       + " | ruler.json |")
            against = next((r for r in ruler.get("against_kvquant", []) if r["model"] == m
                            and r["method"] == COMPARED[0] and r["length"] == "all"), None)
            if against is not None:
                out.append(f"| {_short(m)}, RULER {span} pooled, `q3.5` against `nuq3-1%` on the same questions, "
                           f"points | {_points(against)} | – | ruler.json |")
    for key, what in (("avx512", "AMD EPYC with AVX-512, one layer of SmolLM2-135M (9 query, 3 KV heads of 64), "
                                 "the dense step's SDPA reading each KV head once for its query heads, the preset's "
                                 "fp16 window written and read"),
                      ("forced_avx2", "the same, kernels and torch forced to AVX2 on that machine")):
        spans = []
        for meth in ("nuq@3.5:r32:chan", "nuq3-1%"):
            parts = []
            for n in (8192, 32768):
                lo, hi, runs = _step_ratios(results, STEP_RUNS[key], meth, n)
                parts.append(f"{lo:.2f}–{hi:.2f}×")
            spans.append(" / ".join(parts))
        label = ("decode step against an fp32 cache written in place (`StaticCache`) at 8K / 32K, " + what
                 if key == "avx512" else what)
        out.append(f"| {label}, {runs} runs | " + " | ".join(spans) + f" | {STEP_RUNS[key]} |")
    return "\n".join(out)


# block name -> (JSON file, renderer)
BLOCKS = {
    "headline-compare": (None, headline_compare),  # reads several files from the results folder
    "vllm": ("vllm.json", vllm),
    "tensor-parallel": ("vllm.json", tensor_parallel),
    "tensor-parallel-qwen": ("vllm_tp_qwen.json", tensor_parallel),
    "transfer": ("transfer.json", transfer),
    "transfer-q3.5": ("transfer.json", lambda d: transfer(d, ("nuq3-1%", "q3.5"))),
    "ppl-by-length": ("ppl_by_length.json", ppl_by_length),
    "ruler-questions": ("ruler.json", ruler_questions),
    "ruler-pooled": ("ruler.json", ruler_pooled),
    "ruler-compact": ("ruler_one_sample.json", ruler_compact),
    "ruler-paired": ("ruler_one_sample.json", ruler_paired),
    "ruler": ("ruler_one_sample.json", ruler),
    "ladder": ("ladder.json", ladder),
    "models": ("models.json", models_table),
    "peers": ("peers.json", peers_table),
    "ladder-headline": ("ladder.json", lambda d: ladder(d, HEADLINE)),
    "ladder-budget": ("ladder.json", lambda d: ladder(d, BUDGET_ROWS)),
    "budget-models": ("budget.json", budget_models),
    "budget-gemma8": ("budget_gemma8.json", budget_models),
    "budget-gemma8-kl3": ("budget_gemma8_kl3.json", budget_models),
    "budget-window": ("budget_window.json", budget_models),
    "budget-window-gemma8": ("budget_window_gemma8.json", budget_models),
    "demo": ("demo_amd_epyc.json", demo),
    "mixed-bits": ("eval_mixed_bits.json", ladder),
    "budget-40windows": ("eval_budget_40windows.json", ladder),
    "window-40windows": ("eval_window_40windows.json", ladder),
    "memory": ("memory.json", memory),
    "longctx": ("longctx.json", longctx),
    "decode": ("decode.json", decode),
    "decode-ratios": ("decode.json", decode_ratios),
    "decode-e2e": ("decode.json", e2e),
    "decode-1thread-ratios": ("decode_1thread.json", decode_ratios),
    "decode-30layers-ratios": ("decode_30layers.json", decode_ratios),
    "decode-amd-epyc": ("decode_amd_epyc.json", decode),
    "decode-passes-amd-epyc": ("decode_passes_amd_epyc.json", decode_passes),
    "decode-passes": ("decode_passes.json", decode_passes),
    "decode-passes-cold": ("decode_passes_cold.json", decode_passes),
}
_BLOCK = re.compile(r"(<!-- report:(?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- /report:(?P=name) -->)", re.S)


def render(name: str, results: Path) -> str:
    if name not in BLOCKS:
        raise SystemExit(f"unknown report block {name!r}; known: {', '.join(BLOCKS)}")
    file, fn = BLOCKS[name]
    if file is None:
        return fn(results)
    data = _load(results, file)
    if data is None:
        raise SystemExit(f"block {name!r} needs {results / file}, which is missing: run its benchmark")
    return fn(data)


def fill(text: str, results: Path) -> str:
    """`text` with every marked block rewritten from the JSON."""
    return _BLOCK.sub(lambda m: m[1] + render(m["name"], results) + "\n" + m[4], text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--check", action="store_true", help="only check that the documents' tables are current")
    ap.add_argument("--print", action="store_true", help="print every table instead of writing the documents")
    ap.add_argument("--plot", action="store_true", help="also redraw ppl_by_length.png from longctx.json")
    args = ap.parse_args(argv)
    d = Path(args.results)
    if args.plot and (d / "longctx.json").exists():
        from kvsqueeze.eval.plots import plot_ppl_by_length

        data = json.loads((d / "longctx.json").read_text())
        runs = {}
        for r in data["ppl_by_length"]:
            runs.setdefault(r["seqlen"], {"model": data["model"], "text": data["text"], "seqlen": r["seqlen"],
                                          "rows": []})["rows"].append(r)
        plot_ppl_by_length([runs[n] for n in sorted(runs)], str(d / "ppl_by_length.png"))
    if args.print:
        for name, (file, _) in BLOCKS.items():
            if file is None or _load(d, file) is not None:
                print(f"<!-- report:{name} -->\n{render(name, d)}\n<!-- /report:{name} -->\n")
        return 0
    stale = []
    for doc in DOCUMENTS:
        text = doc.read_text()
        new = fill(text, d)
        if new != text:
            stale.append(doc)
            if not args.check:
                doc.write_text(new)
                print(f"rewrote the tables of {doc.relative_to(ROOT)}")
    if args.check and stale:
        print("tables differ from benchmarks/results/*.json in: " + ", ".join(str(p.relative_to(ROOT)) for p in stale)
              + "; run `python benchmarks/report.py`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
