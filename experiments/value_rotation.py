"""How much a Hadamard rotation of each value head would lower per-token quantization error (a probe, not a method).

    python experiments/value_rotation.py [--recipe out/recipe] [--windows 5]
        [--json experiments/results/value_rotation.json]

On the default model's values for one 2,048-token calibration window (the first token left out, as a sink),
per layer: the relative squared error ||V^ - V||^2 / ||V||^2 of per-token quantization with NormalFloat levels
(2 and 3 bits, with 0% and 1% per-token top-k outliers kept exactly), plain and with every head vector turned
by an orthonormal Hadamard matrix before quantization and turned back after. Unweighted: it shows what the
rotation could buy before any codebook or Fisher weighting is fitted to the rotated values.

With `--recipe`, the end-to-end check: perplexity and KL divergence against fp16 on `--windows` evaluation
windows (as in ladder.json), nuq3-1% and nuq2-1% plain and with their values turned (the recipe's value
codebooks, fitted on unturned values; the stored bits are the same), through the simulated path, with the paired
95% interval of the PPL change. The rotation is applied by wrapping the simulated path's value quantizers here;
it is not a method of the package, because it does not pay enough (see docs/notes.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import kvsqueeze.eval.perplexity as perplexity
from kvsqueeze.numerics.datatypes import normal_float_levels
from kvsqueeze.eval.plots import capture_kv
from kvsqueeze.eval.texts import calibration_windows, evaluation_windows, load_text
from kvsqueeze.integrations.loading import load_model
from kvsqueeze.integrations.simulate import SimulatedQuantization
from kvsqueeze.methods import parse_method
from kvsqueeze.numerics.quantizer import VectorQuantizer
from kvsqueeze.recipe import Recipe
from kvsqueeze.shape import kv_shape

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from common import machine  # noqa: E402


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    if h.shape[0] != n:
        raise SystemExit(f"head_dim {n} is not a power of two")
    return h / n**0.5


class Turned:
    """A value quantizer behind a per-head rotation: turn each head vector by h, quantize, turn it back."""

    def __init__(self, inner: VectorQuantizer, h: torch.Tensor):
        self.inner, self.h = inner, h

    def fake(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        n, c = x.shape
        d = self.h.shape[0]
        y, kept = self.inner.fake((x.float().view(n, c // d, d) @ self.h).view(n, c))
        return (y.float().view(n, c // d, d) @ self.h.T).view(n, c).to(x.dtype), kept


def end_to_end(model, tok, recipe: Recipe, windows: int, h: torch.Tensor):
    """Rows of nuq3-1% and nuq2-1%, plain and turned (the fp16 reference has no value quantizer to turn)."""
    ew = evaluation_windows(tok, load_text("bbc"), 2048, windows)
    specs = [parse_method(n) for n in ("nuq3-1%", "nuq2-1%")]
    rows = [{**r.as_dict(), "values": "plain"} for r in perplexity.evaluate(model, ew.ids, specs, recipe)]

    class TurnedValues(SimulatedQuantization):
        """The simulated path with every layer's value quantizer turned by h (`Turned`)."""

        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            self.v = [v if v is None else Turned(v, h) for v in self.v]

    perplexity.SimulatedQuantization = TurnedValues  # evaluate() builds its quantizers through this name
    try:
        turned = perplexity.evaluate(model, ew.ids, specs, recipe)
    finally:
        perplexity.SimulatedQuantization = SimulatedQuantization
    return rows + [{**r.as_dict(), "values": "turned"} for r in turned], ew


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--json", default="experiments/results/value_rotation.json")
    ap.add_argument("--recipe", help="also measure PPL and KLD end to end with this recipe")
    ap.add_argument("--windows", type=int, default=5)
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
    if args.recipe:
        ppl_rows, ew = end_to_end(model, tok, Recipe.load(args.recipe), args.windows, h)
        payload["end_to_end"] = {"text": "bbc (evaluation part)", "seqlen": 2048, "windows": int(ew.ids.shape[0]),
                                 "window_sources": ew.describe(), "rows": ppl_rows}
        for r in ppl_rows:
            print(r)
    Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
