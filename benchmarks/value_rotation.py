"""How much a Hadamard rotation of each value head would lower per-token quantization error (a probe, not a method).

    python benchmarks/value_rotation.py [--json benchmarks/results/value_rotation.json]

On the default model's values for one 2,048-token calibration window (the first token left out, as a sink),
per layer: the relative squared error ||V^ - V||^2 / ||V||^2 of per-token quantization with NormalFloat levels
(2 and 3 bits, with 0% and 1% per-token top-k outliers kept exactly), plain and with every head vector turned
by an orthonormal Hadamard matrix before quantization and turned back after. Unweighted: it shows what the
rotation could buy before any codebook or Fisher weighting is fitted to the rotated values.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kvsqueeze.datatypes import normal_float_levels
from kvsqueeze.eval.plots import capture_kv
from kvsqueeze.eval.texts import calibration_windows, load_text
from kvsqueeze.integrations.loading import load_model
from kvsqueeze.quantizer import VectorQuantizer
from kvsqueeze.shape import kv_shape

sys.path.insert(0, str(Path(__file__).parent))
from models import machine  # noqa: E402


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    if h.shape[0] != n:
        raise SystemExit(f"head_dim {n} is not a power of two")
    return h / n**0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--json", default="benchmarks/results/value_rotation.json")
    args = ap.parse_args()
    model, tok = load_model(args.model)
    ids = calibration_windows(tok, load_text("bbc").calibration, 1, 2048)
    values = capture_kv(model, ids[:1])["v"]
    d = kv_shape(model.config).head_dim
    h = hadamard(d)
    rows = []
    for bits in (2, 3):
        for fraction in (0.0, 0.01):
            q = VectorQuantizer(normal_float_levels(bits), "token", fraction)
            plain = turned = 0.0
            for v in values:
                v = v[1:]
                n, c = v.shape
                plain += float(((q.fake(v)[0] - v) ** 2).sum() / (v**2).sum())
                r = (v.view(n, c // d, d) @ h).view(n, c)
                back = (q.fake(r)[0].view(n, c // d, d) @ h.T).view(n, c)
                turned += float(((back - v) ** 2).sum() / (v**2).sum())
            rows.append({"bits": bits, "outliers": fraction, "relative_error_plain": round(plain / len(values), 5),
                         "relative_error_rotated": round(turned / len(values), 5)})
            print(rows[-1])
    payload = {"model": args.model, "text": "bbc (calibration part), 1 window of 2048 tokens", "head_dim": d,
               "levels": "NormalFloat", "machine": machine(), "rows": rows}
    Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
