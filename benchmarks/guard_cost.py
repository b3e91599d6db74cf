"""What the finite-value guard adds to a decode step: `check_storable` on one token's keys and values, per layer.

    python benchmarks/guard_cost.py [--out benchmarks/results/guard_cost.json]

Timed on the CPU (where it reads the maximum at once) for the default model's 192 channels and a 7B model's
4,096, float32, median of 7 rounds of 2,000 calls. A whole decode step calls it once per layer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine  # noqa: E402

from kvsqueeze.integrations.layers import Fp16Layer  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "guard_cost.json"))
    args = ap.parse_args(argv)
    layer = Fp16Layer()
    layer.layer_idx = 0
    rows = []
    for channels in (192, 4096):
        k, v = torch.randn(1, 1, channels), torch.randn(1, 1, channels)
        rounds = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(2000):
                layer.check_storable(k, v, "nuq3-1%")
            rounds.append((time.perf_counter() - t0) / 2000 * 1e6)
        rows.append({"channels": channels, "us_per_layer_step": round(statistics.median(rounds), 2),
                     "min": round(min(rounds), 2), "max": round(max(rounds), 2)})
        print(rows[-1])
    payload = {"machine": machine(), "threads": torch.get_num_threads(), "rows": rows,
               "protocol": __doc__.strip().split("\n\n")[2]}
    Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
