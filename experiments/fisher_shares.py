"""How much of a mixed calibration's Fisher weight each text holds.

`calibrate --text mix` takes an equal share of calibration windows from each text of the mix, and every fit that
follows (ranges' outlier counts aside) weighs each key and value element by its Fisher information, the squared
gradient of the window's loss. A text whose windows give far larger gradients then holds far more than its share
of the weight, and the codebooks and the budget's objectives are fitted mostly to it. This runs the calibration's
own collection (`calibrate.collect.collect`, the same windows `calibrate` takes) one window at a time and writes,
per window, its text, its loss and its summed key and value Fisher weight, and per text its share of the whole,
in every layer.

    python experiments/fisher_shares.py [--model gemma3-270m] [--text mix] [--samples 8] [--seqlen 2048]
        [--json experiments/results/fisher_shares.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import machine  # noqa: E402

from kvsqueeze.calibrate.collect import collect  # noqa: E402
from kvsqueeze.config import CalibrationConfig  # noqa: E402
from kvsqueeze.eval.texts import calibration_windows, load_text, mix_shares  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--text", default="mix")
    ap.add_argument("--samples", type=int, default=CalibrationConfig.samples)
    ap.add_argument("--seqlen", type=int, default=CalibrationConfig.seqlen)
    ap.add_argument("--json", default="experiments/results/fisher_shares.json")
    args = ap.parse_args()

    from kvsqueeze.integrations.loading import load_model

    model, tok = load_model(args.model)
    text = load_text(args.text)
    split = mix_shares(text, args.samples) if text.parts else [(text, args.samples)]
    parts = [part.name for part, _ in split]
    names = [part.name for part, n in split for _ in range(n)]  # each window's text, as calibrate takes them
    windows = calibration_windows(tok, text, args.samples, args.seqlen)
    rows = []
    t0 = time.perf_counter()
    for j, name in enumerate(names):
        acts = collect(model, windows[j:j + 1], sinks=CalibrationConfig.sinks, progress=False)
        rows.append({"window": j, "text": name, "loss": round(acts.loss, 4),
                     "key_fisher": [float(f.float().sum()) for f in acts.key_fisher],
                     "value_fisher": [float(f.float().sum()) for f in acts.value_fisher]})
        print(f"window {j} ({name}): loss {acts.loss:.3f}, key Fisher {sum(rows[-1]['key_fisher']):.3g}, "
              f"value Fisher {sum(rows[-1]['value_fisher']):.3g}", flush=True)
    layers = len(rows[0]["key_fisher"])
    shares = {}
    for kind in ("key_fisher", "value_fisher"):
        total = [sum(r[kind][i] for r in rows) for i in range(layers)]
        shares[kind] = {name: [round(sum(r[kind][i] for r in rows if r["text"] == name) / total[i], 4)
                               for i in range(layers)] for name in parts}
    out = {"model": args.model, "text": args.text, "samples": args.samples, "seqlen": args.seqlen,
           "machine": machine(), "seconds": round(time.perf_counter() - t0, 1), "windows": rows,
           "shares_by_layer": shares,
           "shares_all_layers": {kind: {name: round(sum(sum(r[kind]) for r in rows if r["text"] == name)
                                                    / sum(sum(r[kind]) for r in rows), 4) for name in parts}
                                 for kind in ("key_fisher", "value_fisher")}}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["shares_all_layers"]), flush=True)


if __name__ == "__main__":
    main()
