"""How often does a perplexity table's 95% interval hold the true change, at the few windows tables use?

Per-window NLL differences drawn around a known per-token change (each window's own deviation: a text's
windows differ), 4,000 draws per window count. The percentile bootstrap over windows that `paired_interval`
used before (2,000 resamples) against the interval it uses now (`stats.cluster_interval`: Student's t on
windows - 1 degrees of freedom), and how much wider the second is. Pure arithmetic: seconds on any machine.

    python experiments/interval_coverage.py [--json experiments/results/interval_coverage.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch

from kvsqueeze.eval.perplexity import paired_interval

TOKENS = 2047
TRUE = 0.02  # per-token NLL change: +2.02% PPL
SPREAD = 0.01  # window-to-window standard deviation of the per-token change


def bootstrap(nll: torch.Tensor, base: torch.Tensor, tokens: torch.Tensor, g: torch.Generator) -> tuple:
    """The earlier interval: central 95% of 100 * expm1 over 2,000 paired resamples of the windows."""
    w = nll.numel()
    idx = torch.randint(0, w, (2000, w), generator=g)
    per = (nll - base)[idx].sum(1) / tokens.double()[idx].sum(1)
    lo, hi = torch.quantile(100 * torch.expm1(per), torch.tensor([0.025, 0.975], dtype=torch.float64))
    return float(lo), float(hi)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draws", type=int, default=4000)
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "interval_coverage.json"))
    args = ap.parse_args()
    truth = 100 * math.expm1(TRUE)
    rows = []
    for windows in (2, 3, 5, 8, 14, 40):
        g = torch.Generator().manual_seed(windows)
        tokens = torch.full((windows,), TOKENS)
        base = torch.full((windows,), 3.0 * TOKENS, dtype=torch.float64)
        held = {"bootstrap": 0, "t": 0}
        width = {"bootstrap": [], "t": []}
        for _ in range(args.draws):
            nll = base + (TRUE + SPREAD * torch.randn(windows, generator=g, dtype=torch.float64)) * TOKENS
            for name, (lo, hi) in (("bootstrap", bootstrap(nll, base, tokens, g)),
                                   ("t", paired_interval(nll, base, tokens))):
                held[name] += lo <= truth <= hi
                width[name].append(hi - lo)
        rows.append({"windows": windows, "coverage_bootstrap": round(held["bootstrap"] / args.draws, 3),
                     "coverage_t": round(held["t"] / args.draws, 3),
                     "width_ratio_t_over_bootstrap": round(statistics.median(width["t"]) /
                                                           statistics.median(width["bootstrap"]), 2)})
        print(rows[-1], flush=True)
    out = {"question": "coverage of the nominal 95% interval of a PPL change over windows",
           "model": f"per-window per-token NLL change ~ Normal({TRUE}, {SPREAD}), {TOKENS} tokens a window",
           "draws": args.draws, "rows": rows}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
