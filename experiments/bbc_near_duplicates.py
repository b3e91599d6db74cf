"""BBC articles whose text differs from one another but whose title is the same, split between the calibration
and the evaluation parts: how close they are, and how much of the evaluation text they are.

    python experiments/bbc_near_duplicates.py [--json experiments/results/bbc_near_duplicates.json]

`kvsqueeze.eval.texts` keeps a piece met twice once (by an exact hash of its text) and splits pieces by that
hash, so an article published twice with a small edit lands on both sides. A pair is the same title (the first
line, whitespace folded, case ignored) with one article in each part; `similarity` is difflib's ratio of the two
texts. The evaluation characters they hold are counted against the joined evaluation part.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
from pathlib import Path

from kvsqueeze.eval.texts import EVAL_SHARE, _bbc_pieces, load_text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="experiments/results/bbc_near_duplicates.json")
    args = ap.parse_args()
    text = load_text("bbc")
    seen, calib, evals = set(), {}, {}
    for label, body in _bbc_pieces():
        digest = hashlib.sha1(body.encode()).digest()
        if not body or digest in seen:
            continue
        seen.add(digest)
        title = " ".join(body.split("\n", 1)[0].split()).lower()
        side = evals if digest[0] % EVAL_SHARE == 0 else calib
        side.setdefault(title, []).append((label, body))
    pairs = []
    for title, held in evals.items():
        for label, body in held:
            for other, twin in calib.get(title, []):
                pairs.append({"evaluation": label, "calibration": other, "characters": len(body),
                              "similarity": round(difflib.SequenceMatcher(None, body, twin).ratio(), 3)})
    chars = sum(p["characters"] for p in {p["evaluation"]: p for p in pairs}.values())
    result = {"pairs": pairs, "evaluation_articles": sum(len(v) for v in evals.values()),
              "articles_with_a_twin": len({p["evaluation"] for p in pairs}),
              "evaluation_characters": len(text.evaluation), "twin_characters": chars,
              "twin_share": round(chars / len(text.evaluation), 4)}
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "pairs"}, indent=1))
    for p in sorted(pairs, key=lambda p: p["similarity"]):
        print(f"  {p['evaluation']} / {p['calibration']}: {p['similarity']:.3f}")


if __name__ == "__main__":
    main()
