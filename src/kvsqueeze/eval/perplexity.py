"""Perplexity of a model whose KV cache goes through a quantization method (simulated), and how far its
next-token distribution moves from the fp16 cache's.

Each window is one teacher-forced forward pass through a fresh cache, so every
key and value is quantized the way the method stores it, and the average bits
count what the cache would hold at the end of the window (with the outliers
actually kept). Against the fp16 method on the same windows: the PPL change
with a paired 95% interval over windows (`paired_interval`), the mean and 99th-percentile
KL divergence per token and the top-1 agreement (llama.cpp's perplexity tool
reports the same three).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..integrations.simulate import SimulatedQuantization
from ..methods import MethodSpec, is_unquantized, parse_method
from ..recipe import Recipe
from .stats import cluster_interval
from .tables import text_table


@dataclass(frozen=True)
class PplRow:
    """One method over the evaluation windows.

    ppl, nll: perplexity and mean next-token NLL; tokens: predicted tokens. The distribution metrics are taken
    against the fp16 method's next-token distribution on the same windows, as llama.cpp's perplexity tool
    reports them: kld_mean, kld_p99 (mean and 99th percentile of the per-token KL divergence, nats) and top1
    (the share of tokens whose most likely next token is fp16's). ci95: a 95% interval of the PPL change against
    fp16 in percent, paired over the windows (`paired_interval`; None for fp16 itself, or with a single window).
    window_nll: the summed NLL of each window.
    """

    method: str
    avg_bits: float
    ppl: float
    nll: float
    tokens: int
    kld_mean: float = 0.0
    kld_p99: float = 0.0
    top1: float = 1.0
    ci95: tuple[float, float] | None = None
    window_nll: tuple[float, ...] = ()

    def as_dict(self) -> dict:
        return {"method": self.method, "avg_bits": round(self.avg_bits, 4), "ppl": round(self.ppl, 4),
                "ci95": None if self.ci95 is None else [round(x, 3) for x in self.ci95],
                "kld_mean": round(self.kld_mean, 6), "kld_p99": round(self.kld_p99, 6), "top1": round(self.top1, 5)}


ROWS = 256  # positions per piece where a window's [T, V] rows are normalised or compared: a piece's temporaries are
# ROWS x V floats, not a second and third copy of the window's logits (2 GB a window over Gemma-3's 262K words)


@torch.no_grad()
def window_logits(model, ids: torch.Tensor, sim: SimulatedQuantization) -> torch.Tensor:
    """Next-token log-probabilities [B, T-1, V] (float32) of ids [B, T] through a fresh simulated cache,
    normalised in place, ROWS positions at a time (the same values as one `log_softmax` over the whole)."""
    ids = ids.to(next(model.parameters()).device)
    out = model(input_ids=ids, cache=sim.new_cache(), use_cache=True)
    logits = out.logits[:, :-1].float()  # the model's own tensor when it returns float32: overwritten below
    del out
    for row in logits:
        for r in range(0, row.shape[0], ROWS):
            piece = row[r:r + ROWS]
            if not torch.isfinite(piece).all():  # piece by piece: isfinite makes a float copy and masks of its input
                raise FloatingPointError(f"method {sim.spec.name!r} produced NaN/Inf logits")
            row[r:r + ROWS] = piece.log_softmax(dim=-1)
    return logits


def window_nll(model, ids: torch.Tensor, sim: SimulatedQuantization) -> tuple[float, int]:
    """Summed next-token NLL over ids [B, T] and the number of predicted tokens."""
    logp = window_logits(model, ids, sim)
    target = ids[:, 1:].to(logp.device)
    return float(-logp.gather(2, target[..., None]).sum()), int(target.numel())


def paired_interval(nll: torch.Tensor, base: torch.Tensor, tokens: torch.Tensor) -> tuple[float, float] | None:
    """95% interval of 100 * (PPL / PPL_base - 1) over the windows, the same windows for both (nll, base: summed
    NLL per window; tokens: predicted tokens per window): the interval of the per-token NLL difference with each
    window one cluster (`stats.cluster_interval`: Student's t on windows - 1 degrees of freedom, a window's tokens
    sharing its text and its cache), mapped through 100 * expm1. None with one window."""
    ci = cluster_interval((nll.double() - base.double()).tolist(), tokens.double().tolist())
    return None if ci is None else (100 * math.expm1(ci[0]), 100 * math.expm1(ci[1]))


def mean_interval(sums: torch.Tensor, tokens: torch.Tensor) -> tuple[float, float] | None:
    """95% interval of a per-token mean (e.g. KL divergence: summed per window in `sums`, over `tokens` per
    window), each window one cluster as in `paired_interval`. None with one window."""
    return cluster_interval(sums.double().tolist(), tokens.double().tolist())


def against_reference(ref: torch.Tensor, ref_top: torch.Tensor, logp: torch.Tensor,
                      target: torch.Tensor) -> tuple[float, torch.Tensor, int]:
    """One window's summed NLL of `logp` [T-1, V] on `target` [T-1], its per-token KL divergence from the
    reference distribution (ref: log-probabilities), and how many of its top tokens are the reference's
    (ref_top). The divergence is taken ROWS positions at a time: no [T-1, V] temporaries."""
    nll = float(-logp.gather(1, target[:, None]).sum())
    kld = torch.cat([(ref[r:r + ROWS].exp() * (ref[r:r + ROWS] - logp[r:r + ROWS])).sum(-1)
                     for r in range(0, ref.shape[0], ROWS)]).clamp_min(0).cpu()
    return nll, kld, int((logp.argmax(-1) == ref_top).sum())


def row_from_windows(name: str, avg_bits: float, nll: list[float], tokens: list[int], klds: list[torch.Tensor],
                     top1: int, base_nll: list[float] | None) -> PplRow:
    """A `PplRow` from per-window results (base_nll: the fp16 method's, for the interval; None for fp16)."""
    nll_t, tok = torch.tensor(nll), torch.tensor(tokens)
    count = int(tok.sum())
    mean = float(nll_t.sum()) / count
    kld = torch.cat(klds).double()
    ci = None if base_nll is None else paired_interval(nll_t, torch.tensor(base_nll), tok)
    return PplRow(name, avg_bits, math.exp(mean), mean, count, float(kld.mean()),
                  float(torch.quantile(kld, 0.99)) if kld.numel() else 0.0, top1 / count, ci, tuple(nll))


def evaluate(
    model,
    windows: torch.Tensor,
    specs: list[MethodSpec],
    recipe: Recipe | None = None,
    progress: bool = True,
    recipes: dict[str, Recipe] | None = None,
    checkpoint: str | Path | None = None,
) -> list[PplRow]:
    """Perplexity, average stored bits, KL divergence and top-1 agreement against fp16, and a paired 95% interval
    of the PPL change, for each method over windows [W, T].

    Windows run one at a time: the fp16 method's distribution on a window is computed once (whether fp16 is
    among `specs` or not) and each method is compared with it on that window. `recipes` maps a method's name to
    the recipe it reads instead of `recipe` (e.g. one calibrated with the method's sink count).

    `checkpoint`: a safetensors file that keeps every finished window's results (rewritten whole after each window, never
    half-written); a call given the same file, windows and methods resumes after the last window it holds and
    returns what one uninterrupted call would. A file made for other windows, methods or recipes (by content) is
    refused.
    """
    from ..shape import context_length

    if windows.dim() != 2 or windows.shape[0] < 1 or windows.shape[1] < 2:
        raise ValueError(f"evaluate: windows must be token ids [W windows, T >= 2 tokens], got {tuple(windows.shape)}"
                         " (one window of ids: ids.view(1, -1))")
    limit = context_length(model.config)
    if limit and windows.shape[1] > limit:
        raise ValueError(f"evaluate: windows of {windows.shape[1]} tokens are longer than the model's {limit}-token "
                         f"context (positions past it were never trained); use windows of up to {limit} tokens")
    recipes = recipes or {}
    fp16 = parse_method("fp16")
    names = [s.name for s in specs]
    acc = {n: {"nll": [], "tok": [], "kld": [], "top1": 0, "bits": 0.0, "elems": 0.0} for n in names}
    base_nll = []
    used = {s.name: recipes.get(s.name, recipe) for s in specs}  # whose tables each method's numbers come from
    digests = {n: (r.meta.get("tensors_sha256") if r is not None else None) for n, r in used.items()}
    if checkpoint is not None:
        from ..integrations.parts import layer_windows
        from ..methods.budget import STORAGE_VERSION

        # bits on sliding-window layers are counted by what they hold (storage version 4 on): windows of a
        # sliding model counted another way, or for other windows, must not join these
        slides = layer_windows(model)
        if any(w is not None for w in slides):
            digests = {**digests, "sliding": {"layer_windows": slides, "storage_version": STORAGE_VERSION}}
    if checkpoint is not None:  # windows of another model (one with the same tokenizer) or dtype must not join
        from ..integrations.fingerprint import model_fingerprint

        weights = json.dumps(model_fingerprint(model), sort_keys=True, default=str).encode()
        digests = {**digests, "model": {"fingerprint": hashlib.sha256(weights).hexdigest()[:16],
                                        "dtype": str(next(model.parameters()).dtype)}}
    saved = _Checkpoint(checkpoint, windows, names, digests) if checkpoint is not None else None
    done = saved.restore(acc, base_nll) if saved is not None else 0
    # quantizers built (and the recipe checked) once per method; each window only installs the hooks
    sims = {s.name: SimulatedQuantization(model, s, recipes.get(s.name, recipe)) for s in specs}
    reference = sims.get(fp16.name) or SimulatedQuantization(model, fp16, recipe)
    bar = tqdm(total=len(specs) * windows.shape[0], initial=len(specs) * done, disable=not progress, desc="eval",
               unit="win")
    for w in windows[done:]:
        ids = w.view(1, -1)
        with reference as sim:
            ref = window_logits(model, ids, sim)[0]  # [T-1, V]
        target = ids[0, 1:].to(ref.device)
        ref_top = ref.argmax(-1)
        base_nll.append(float(-ref.gather(1, target[:, None]).sum()))
        for spec in specs:
            bar.set_postfix_str(spec.name)
            a = acc[spec.name]
            with sims[spec.name] as sim:
                logp = ref if spec == fp16 else window_logits(model, ids, sim)[0]
                held = 8 * sum(sim.storage(w.numel()).values())  # bits, every component counted
            nll, kld, top1 = against_reference(ref, ref_top, logp, target)
            a["nll"].append(nll)
            a["tok"].append(int(target.numel()))
            a["kld"].append(kld)
            a["top1"] += top1
            a["bits"], a["elems"] = a["bits"] + held, a["elems"] + sim.elements(w.numel())
            bar.update(1)
        if saved is not None:
            saved.write(acc, base_nll)
    bar.close()
    return [row_from_windows(s.name, acc[s.name]["bits"] / acc[s.name]["elems"], acc[s.name]["nll"],
                             acc[s.name]["tok"], acc[s.name]["kld"], acc[s.name]["top1"],
                             None if s == fp16 else base_nll) for s in specs]


class _Checkpoint:
    """`evaluate`'s finished windows in one safetensors file: each window's per-token KL divergences as tensors,
    the running sums as JSON in its metadata, tied to its windows and methods."""

    def __init__(self, path: str | Path, windows: torch.Tensor, names: list[str], recipes: dict[str, str | None]):
        self.path = Path(path)
        self.names = names
        digest = hashlib.sha256(windows.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()
        # each method's recipe by content: a recipe calibrated again between two runs must not join their windows
        self.key = {"windows": list(windows.shape), "ids_sha256": digest, "methods": names, "recipes": recipes}

    def restore(self, acc: dict, base_nll: list) -> int:
        """Fill the running sums from the file; the number of windows it holds (0 without a file)."""
        if not self.path.is_file():
            return 0
        try:
            tensors, held = _read_checkpoint(self.path)
        except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same advice
            raise ValueError(f"checkpoint {self.path} cannot be read ({exc}); delete it to start again") from exc
        key = held.get("key")
        if isinstance(key, dict) and "model" not in key.get("recipes", {}):  # a file from before keys named it
            key = {**key, "recipes": {**key.get("recipes", {}), "model": self.key["recipes"].get("model")}}
        if key != self.key:
            raise ValueError(f"checkpoint {self.path} was made for other windows, methods or recipes "
                             f"({held.get('key')}); delete it or give another file")
        for i, name in enumerate(self.names):
            acc[name].update(held["acc"][name])
            acc[name]["kld"] = [tensors[f"kld.{i}.{w}"] for w in range(len(held["base_nll"]))]
        base_nll.extend(held["base_nll"])
        return len(base_nll)

    def write(self, acc: dict, base_nll: list) -> None:
        from safetensors.torch import save_file

        tensors = {f"kld.{i}.{w}": k.contiguous() for i, name in enumerate(self.names)
                   for w, k in enumerate(acc[name]["kld"])}
        sums = {name: {k: v for k, v in acc[name].items() if k != "kld"} for name in self.names}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        save_file(tensors, str(tmp), metadata={"evaluate": json.dumps({"key": self.key, "acc": sums,
                                                                       "base_nll": base_nll})})
        tmp.replace(self.path)


def _read_checkpoint(path: Path) -> tuple[dict, dict]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["evaluate"])


def checkpoint_windows(path: str | Path) -> int:
    """How many finished windows an `evaluate` checkpoint holds (0 without a file)."""
    path = Path(path)
    return len(_read_checkpoint(path)[1]["base_nll"]) if path.is_file() else 0


def format_table(rows: list[PplRow]) -> str:
    """Method, average bits, perplexity, change against fp16 (when it was measured) with its 95% interval, and
    the distribution metrics against fp16."""
    base = next((r.ppl for r in rows if is_unquantized(r.method)), None)
    body = []
    for r in rows:
        change = f"{(r.ppl / base - 1) * 100:+.2f}%" if base else "-"
        ci = f"[{r.ci95[0]:+.2f}, {r.ci95[1]:+.2f}]" if r.ci95 else "-"
        body.append((r.method, f"{r.avg_bits:.3f}", f"{r.ppl:.3f}", change, ci, f"{r.kld_mean:.4f}",
                     f"{r.kld_p99:.4f}", f"{100 * r.top1:.2f}%"))
    return text_table(("method", "avg bits", "PPL", "vs fp16", "95% CI", "KLD", "KLD p99", "top-1"), body,
                      rule=False)
