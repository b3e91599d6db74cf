"""Render the benchmark JSON files in benchmarks/results/ as the Markdown tables of the README.

    python benchmarks/report.py [--results benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _load(d: Path, name: str) -> dict | None:
    p = d / name
    return json.loads(p.read_text()) if p.exists() else None


def describe(name: str) -> str:
    """A short description of a method from its name (for rows outside the ablation ladder)."""
    from kvsqueeze.methods import parse_method

    spec = parse_method(name)
    if spec.family in ("kivi", "group", "fp16"):
        return {"kivi": f"KIVI, groups of {spec.group_size}, {spec.window} recent tokens fp16",
                "group": f"uniform per token, groups of {spec.group_size} channels",
                "fp16": "unquantized"}[spec.family]
    dtype = {"int": "uniform", "nf": "NormalFloat", "nuq": "nuq"}[spec.family]
    bits = f"K{spec.k_bits}V{spec.v_bits}, " if spec.k_bits != spec.v_bits else ""
    keys = f"K per-{spec.key_axis} {spec.key_rope}-RoPE"
    extra = f", {spec.pct_label} outliers" if spec.outlier_fraction else ""
    extra += f", {spec.sinks} sink" if spec.sinks else ""
    return f"{bits}{dtype}, {keys}{extra}"


def ladder(data: dict) -> str:
    base = next(r["ppl"] for r in data["rows"] if r["method"] == "fp16")
    out = [f"{data['model']}, {data['text']}, {data['windows']} windows of {data['seqlen']} tokens "
           f"({data.get('machine', 'x86_64, 2 cores')})\n", "| method | what | avg bits | PPL | vs fp16 |", "|---|---|---:|---:|---:|"]
    for r in data["rows"]:
        step = r.get("step", "")
        what = step if step and not step.endswith("-bit") else describe(r["method"])
        out.append(f"| `{r['method']}` | {what} | {r['avg_bits']:.2f} | {r['ppl']:.3f} | "
                   f"{(r['ppl'] / base - 1) * 100:+.2f}% |")
    return "\n".join(out)


def memory(data: dict) -> str:
    out = [f"{data['model']}, {data['tokens']} tokens of {data['text']} ({data['machine']})\n",
           "| cache | bytes / token (all layers) | vs fp16 | bits / element | measured from |", "|---|---:|---:|---:|---|"]
    for r in data["rows"]:
        out.append(f"| `{r['method']}` | {r['bytes_per_token']:,.0f} | {r['compression_vs_fp16']:.2f}× | "
                   f"{r.get('avg_bits', float('nan')):.2f} | {r.get('source', '')} |")
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--plot", action="store_true", help="also redraw ppl_by_length.png from longctx.json")
    args = ap.parse_args()
    d = Path(args.results)
    if args.plot and (d / "longctx.json").exists():
        from kvsqueeze.eval.plots import plot_ppl_by_length

        data = json.loads((d / "longctx.json").read_text())
        runs = {}
        for r in data["ppl_by_length"]:
            runs.setdefault(r["seqlen"], {"model": data["model"], "text": data["text"], "seqlen": r["seqlen"],
                                          "rows": []})["rows"].append(r)
        plot_ppl_by_length([runs[n] for n in sorted(runs)], str(d / "ppl_by_length.png"))
    for name, fn in (("ladder.json", ladder), ("eval_mixed_bits.json", ladder), ("memory.json", memory),
                     ("longctx.json", longctx), ("decode.json", decode), ("decode_1thread.json", decode),
                     ("decode_30layers.json", decode), ("decode_passes.json", decode_passes),
                     ("decode_passes_cold.json", decode_passes)):
        data = _load(d, name)
        if data is not None:
            print(f"### {name}\n\n{fn(data)}\n")


if __name__ == "__main__":
    main()
