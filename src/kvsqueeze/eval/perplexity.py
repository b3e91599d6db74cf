"""Perplexity of a model whose KV cache goes through a quantization method (simulated).

Each window is one teacher-forced forward pass through a fresh cache, so every
key and value is quantized the way the method stores it, and the average bits
count what the cache would hold at the end of the window (with the outliers
actually kept).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..integrations.simulate import SimulatedQuantization
from ..methods import MethodSpec
from ..recipe import Recipe
from .tables import text_table


@dataclass(frozen=True)
class PplRow:
    method: str
    avg_bits: float
    ppl: float
    nll: float
    tokens: int


@torch.no_grad()
def window_nll(model, ids: torch.Tensor, sim: SimulatedQuantization) -> tuple[float, int]:
    """Summed next-token NLL over ids [B, T] and the number of predicted tokens."""
    ids = ids.to(next(model.parameters()).device)
    out = model(input_ids=ids, cache=sim.new_cache(), use_cache=True)
    logits = out.logits[:, :-1].float()
    if not torch.isfinite(logits).all():
        raise FloatingPointError(f"method {sim.spec.name!r} produced NaN/Inf logits")
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")
    return float(nll), ids[:, 1:].numel()


def evaluate(
    model,
    windows: torch.Tensor,
    specs: list[MethodSpec],
    recipe: Recipe | None = None,
    progress: bool = True,
) -> list[PplRow]:
    """Perplexity and average stored bits for each method over windows [W, T]."""
    rows = []
    bar = tqdm(total=len(specs) * windows.shape[0], disable=not progress, desc="eval", unit="win")
    for spec in specs:
        nll_sum, count, bits, elems = 0.0, 0, 0.0, 0.0
        with SimulatedQuantization(model, spec, recipe) as sim:
            for w in windows:
                bar.set_postfix_str(spec.name)
                nll, n = window_nll(model, w.view(1, -1), sim)
                st = sim.storage(w.numel())
                nll_sum, count = nll_sum + nll, count + n
                bits, elems = bits + st["total"], elems + st["elements"]
                bar.update(1)
        mean = nll_sum / count
        rows.append(PplRow(spec.name, bits / elems, math.exp(mean), mean, count))
    bar.close()
    return rows


def format_table(rows: list[PplRow]) -> str:
    """Method, average bits, perplexity and change against fp16 (when it was measured)."""
    base = next((r.ppl for r in rows if r.method == "fp16"), None)
    body = [(r.method, f"{r.avg_bits:.3f}", f"{r.ppl:.3f}", f"{(r.ppl / base - 1) * 100:+.2f}%" if base else "-")
            for r in rows]
    return text_table(("method", "avg bits", "PPL", "vs fp16"), body, rule=False)
