"""Segment-by-segment scoring of long windows equals the whole-logits evaluation, and models whose logits are not
their output head are refused."""

from __future__ import annotations

import math

import pytest
import torch

from kvsqueeze.eval.long_ppl import HeadError, check_head, head, hidden_states, score_window
from kvsqueeze.eval.perplexity import evaluate
from kvsqueeze.integrations.simulate import SimulatedQuantization
from kvsqueeze.methods import parse_method

from conftest import HIDDEN, VOCAB, random_ids


@pytest.mark.parametrize("method", ["nuq3-1%", "nuq@3.5:r8:chan", "kivi2"])
def test_segments_give_what_whole_logits_give(tiny_llama, tiny_recipe, method):
    ids = random_ids(1, 200, seed=3)  # past KIVI's 128 fp16 tokens
    spec, fp16 = parse_method(method), parse_method("fp16")
    whole = {r.method: r for r in evaluate(tiny_llama, ids, [fp16, spec], tiny_recipe, progress=False)}
    with SimulatedQuantization(tiny_llama, fp16, tiny_recipe) as sim:
        reference = hidden_states(tiny_llama, ids, sim.new_cache())
    with SimulatedQuantization(tiny_llama, spec, tiny_recipe) as sim:
        hidden = hidden_states(tiny_llama, ids, sim.new_cache())
    score = score_window(tiny_llama, ids, hidden, reference, segment=48)
    assert score.tokens == [48, 48, 48, 48, 7]
    row = whole[spec.name]
    assert sum(score.nll) / sum(score.tokens) == pytest.approx(row.nll, rel=1e-5)
    assert score.kld_sum / sum(score.tokens) == pytest.approx(row.kld_mean, rel=1e-4, abs=1e-7)
    assert score.top1 / sum(score.tokens) == pytest.approx(row.top1)
    ref = score_window(tiny_llama, ids, reference, reference, segment=48)
    assert sum(ref.nll) / 199 == pytest.approx(whole["fp16"].nll, rel=1e-5) and ref.kld_sum == 0 and ref.top1 == 199
    assert math.isfinite(score.kld_sum) and score.kld_sum > 0


def test_soft_capped_logits_are_scored_as_the_model_gives_them():
    from transformers import AutoModelForCausalLM, Gemma2Config

    cfg = Gemma2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, final_logit_softcapping=3.0,
                       sliding_window=8, max_position_embeddings=256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # raw logits far past the cap (about 0.6 at random init): a cap left out shows
        model.lm_head.weight.mul_(50.0)
    ids = random_ids(1, 40)
    fp16 = parse_method("fp16")
    check_head(model, ids, lambda: SimulatedQuantization(model, fp16).new_cache())  # the cap is applied
    with SimulatedQuantization(model, fp16) as sim:
        capped = head(model, hidden_states(model, ids, sim.new_cache()))
    assert 2.9 < float(capped.abs().max()) <= 3.0  # saturated at the cap, not past it


def test_a_model_whose_logits_are_not_its_head_is_refused(tiny_llama):
    fp16 = parse_method("fp16")

    def scaled(module, args, out):  # a logit scale the output head does not carry
        out.logits = out.logits * 2.0
        return out

    hook = tiny_llama.register_forward_hook(scaled)
    try:
        with pytest.raises(HeadError, match="not its output embeddings applied to the final hidden states"):
            check_head(tiny_llama, random_ids(1, 40), lambda: SimulatedQuantization(tiny_llama, fp16).new_cache())
    finally:
        hook.remove()
