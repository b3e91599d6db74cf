"""Perplexity over windows whose logits do not fit in memory (a 32K-token window of a 150K-word vocabulary is 20 GB
of float32 logits), scored segment by segment.

One teacher-forced forward pass per method and window, through the method's simulated cache (every key and value
quantized as the method stores it, as `perplexity.evaluate` does), returns the final hidden states [T, H]; the
output head then runs over `segment` positions at a time, for the method and for the fp16 reference of the same
window, so that only two segments of logits are ever held. Each segment gives its summed NLL, the KL divergence of
every token from the reference and the top-1 agreement; the paired interval of the PPL change resamples segments
(blocks of `segment` consecutive tokens, paired with the reference's same block) across all windows of a length,
since a handful of 32K windows is too few to resample windows.

The output head is the model's `get_output_embeddings()` with its final soft-capping where the config has one;
`check_head` refuses a model whose logits are anything else (a scale, a bias the head does not carry), before
any long forward is run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .perplexity import against_reference


class HeadError(ValueError):
    """The model's logits are not its output head applied to its final hidden states."""


@dataclass
class WindowScore:
    """One method on one window: per-segment summed NLL and tokens, and the distribution metrics' sums."""

    nll: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    kld_sum: float = 0.0
    top1: int = 0
    held_bits: float = 0.0  # what the cache holds at the end of the window, every component counted
    elements: float = 0.0  # the key and value elements it stands for

    def as_dict(self) -> dict:
        return {"nll": [round(x, 4) for x in self.nll], "tokens": self.tokens, "kld_sum": round(self.kld_sum, 5),
                "top1": self.top1, "held_bits": self.held_bits, "elements": self.elements}


def _decoder(model):
    base = getattr(model, "model", None)
    if base is None or not callable(base):
        raise HeadError(f"{type(model).__name__} has no `.model` decoder to read final hidden states from; "
                        "evaluate it with windows short enough for whole logits (kvsqueeze eval)")
    return base


def head(model, hidden: torch.Tensor) -> torch.Tensor:
    """Logits (float32) of hidden states [N, H]: the output embeddings, soft-capped where the config says so."""
    logits = model.get_output_embeddings()(hidden.to(model.get_output_embeddings().weight.dtype)).float()
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    cap = getattr(cfg, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


@torch.no_grad()
def hidden_states(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """Final hidden states [T, H] (after the last norm) of one window ids [1, T] through `cache`: the whole model
    runs (so that the hooks a simulated cache puts on it fire), asked for the last position's logits only, and the
    decoder's output is read on its way out."""
    ids = ids.to(next(model.parameters()).device)
    seen = []

    def grab(module, args, output):
        seen.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

    handle = _decoder(model).register_forward_hook(grab)
    try:
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    finally:
        handle.remove()
    if len(seen) != 1:
        raise HeadError(f"{type(model).__name__}: its decoder ran {len(seen)} times in one forward")
    h = seen[0][0]
    if not torch.isfinite(h).all():
        raise FloatingPointError("the forward produced NaN/Inf hidden states")
    return h


@torch.no_grad()
def check_head(model, ids: torch.Tensor, cache_factory) -> None:
    """Refuse a model whose forward's logits differ from `head(hidden_states(...))` on a short prefix of ids."""
    short = ids[:, : min(ids.shape[1], 32)].to(next(model.parameters()).device)
    whole = model(input_ids=short, cache=cache_factory(), use_cache=True).logits[0].float()
    mine = head(model, hidden_states(model, short, cache_factory()))
    err = float((whole - mine).abs().max())
    if err > 1e-3 * max(1.0, float(whole.abs().max())):
        raise HeadError(f"{type(model).__name__}: its logits are not its output embeddings applied to the final "
                        f"hidden states (max difference {err:.3g}); long windows cannot be scored segment by "
                        "segment, evaluate with windows short enough for whole logits (kvsqueeze eval)")


@torch.no_grad()
def score_window(model, ids: torch.Tensor, hidden: torch.Tensor, reference: torch.Tensor, segment: int) -> WindowScore:
    """Segment-by-segment NLL of ids [1, T] from `hidden` [T, H], and KL divergence and top-1 against the
    reference hidden states of the same window (`hidden is reference`: the reference itself)."""
    target = ids[0, 1:].to(hidden.device)
    score = WindowScore()
    n = target.numel()
    for s in range(0, n, segment):
        e = min(n, s + segment)
        ref = head(model, reference[s:e]).log_softmax(-1)
        logp = ref if hidden is reference else head(model, hidden[s:e]).log_softmax(-1)
        nll, kld, top1 = against_reference(ref, ref.argmax(-1), logp, target[s:e])
        score.nll.append(nll)
        score.tokens.append(e - s)
        score.kld_sum += float(kld.double().sum())
        score.top1 += top1
    return score
