"""Name the context of every logged RULER answer that predates the digest (one-off, resumable, checked).

An answer's key now carries `context`: a digest of its context's text and its question's text
(`kvsqueeze.eval.ruler.question_digest`), so that answers asked on another haystack, task set or layout are not
taken for this one's. This rebuilds the contexts `benchmarks/ruler.py` asked (its JSON's runs, seed, tasks and
layout; the BBC evaluation part), checks each logged answer's expected strings against its rebuilt question
(any difference stops the script before it writes), and rewrites the answers file whole with the digests added.
Answers that already carry one are left as they are.

    python experiments/ruler_context_digests.py [--answers benchmarks/results/ruler_answers.jsonl]
        [--json benchmarks/results/ruler.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--answers", default="benchmarks/results/ruler_answers.jsonl")
    ap.add_argument("--json", default="benchmarks/results/ruler.json")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from kvsqueeze.eval.ruler import build_contexts, question_digest
    from kvsqueeze.eval.texts import load_text
    from kvsqueeze.integrations.loading import resolve_model_path

    config = json.loads(Path(args.json).read_text())["config"]
    path = Path(args.answers)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    haystack = load_text("bbc").evaluation
    digests = {}
    for run in config["runs"]:
        mine = [r for r in rows if r["model"] == run["model"] and not r.get("context")]
        if not mine:
            continue
        tok = AutoTokenizer.from_pretrained(resolve_model_path(run["model"]))
        for n in run["lengths"]:
            at = [r for r in mine if r["length"] == n]
            if not at:
                continue
            samples = max(r["sample"] for r in at) + 1
            for c in build_contexts(tok, haystack, n, samples, seed=config["seed"], tasks=config["tasks"],
                                    layout=run["layout"]):
                for q in c.questions:
                    digests[(run["model"], n, c.sample, c.seed, q.task, q.item)] = (question_digest(c, q), q.answers)
            print(f"{run['model']} @ {n}: {samples} sample(s) rebuilt", flush=True)
    missing, wrong = 0, 0
    for r in rows:
        if r.get("context"):
            continue
        hit = digests.get((r["model"], r["length"], r["sample"], r["seed"], r["task"], r.get("item", 0)))
        if hit is None:
            missing += 1
            continue
        if tuple(r["expected"]) != tuple(hit[1]):
            wrong += 1
            continue
        r["context"] = hit[0]
    if missing or wrong:
        raise SystemExit(f"{missing} answers match no rebuilt question and {wrong} expect other strings than the "
                         "rebuilt ones: nothing written")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)
    print(f"{len(rows)} answers, every one naming its context")


if __name__ == "__main__":
    main()
