"""Passkey through both engines: the compressed cache answers exactly as the simulated path."""

import pytest
import torch

from kvsqueeze.calibrate.collect import collect
from kvsqueeze.calibrate.fit import CalibrationConfig, fit_recipe
from kvsqueeze.eval.longctx import passkey_eval
from kvsqueeze.methods import parse_methods


def _tiny_tokenizer():
    class Tok:
        eos_token_id = 0

        def __call__(self, text, return_tensors=None, add_special_tokens=True):
            ids = [1 + (b % 250) for b in text.encode()]
            return {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids}

        def encode(self, text):
            return self(text)["input_ids"]

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(47 + (int(i) % 11)) for i in ids)  # digits and '/' so answers can be scored

    return Tok()


def test_engines_agree_on_a_tiny_model(tiny_llama):
    """Each passkey prompt's greedy answer is the same through the simulated path and the compressed cache, for
    every method the cache holds (a random-weight model answers no passkey right: its answers are compared, not
    its scores); and `passkey_eval` runs both engines to the same scores."""
    import kvsqueeze
    from kvsqueeze.eval.longctx import greedy_answer
    from kvsqueeze.eval.passkey import build_passkey_prompts
    from kvsqueeze.integrations.prefill import compressed
    from kvsqueeze.integrations.simulate import SimulatedQuantization

    model = tiny_llama
    tok = _tiny_tokenizer()
    ids = torch.randint(1, 250, (2, 96), generator=torch.Generator().manual_seed(3))
    recipe = fit_recipe(model, collect(model, ids, sinks=1, progress=False),
                        CalibrationConfig(samples=2, seqlen=96, bits=(3,), fractions=(0.0, 0.01)), "tiny", "rand",
                        progress=False)
    specs = parse_methods("nuq3-1%,nuq3")
    assert all(compressed(s) for s in specs)
    for spec in specs:
        for prompt in build_passkey_prompts(tok, 300, 2, seed=5):
            with SimulatedQuantization(model, spec, recipe) as sim:
                a = greedy_answer(model, tok, prompt.text, sim.new_cache())
            with kvsqueeze.cache_for(model, recipe, spec) as cache:
                b = greedy_answer(model, tok, prompt.text, cache)
            assert a and a == b, (spec.name, a, b)
    got = {engine: [(r.method, r.correct) for r in passkey_eval(model, tok, specs, [300], trials=2, recipe=recipe,
                                                                   progress=False, engine=engine)]
           for engine in ("sim", "cache")}
    assert got["sim"] == got["cache"]


def test_bad_engine_rejected(tiny_llama):
    with pytest.raises(ValueError, match="engine"):
        passkey_eval(tiny_llama, _tiny_tokenizer(), parse_methods("fp16"), [300], 1, engine="gpu")


@pytest.mark.slow
def test_default_model_passkey_same_answers_through_cache_and_simulation(default_model, default_recipe):
    from kvsqueeze.eval.longctx import greedy_answer
    from kvsqueeze.eval.passkey import build_passkey_prompts
    from kvsqueeze.integrations.simulate import SimulatedQuantization
    import kvsqueeze

    model, tok = default_model
    spec = parse_methods("nuq3-1%")[0]
    for prompt in build_passkey_prompts(tok, 1024, 2, seed=7):
        with SimulatedQuantization(model, spec, default_recipe) as sim:
            a = greedy_answer(model, tok, prompt.text, sim.new_cache(), max_new_tokens=16)
        with kvsqueeze.cache_for(model, default_recipe, spec) as cache:
            b = greedy_answer(model, tok, prompt.text, cache, max_new_tokens=16)
        assert a == b


def test_full_context_length_leaves_room_for_the_answer(tiny_llama):
    limit = tiny_llama.config.max_position_embeddings
    res = passkey_eval(tiny_llama, _tiny_tokenizer(), parse_methods("fp16"), [limit], trials=1, progress=False)
    assert res[0].length == limit and res[0].trials == 1
    with pytest.raises(ValueError, match="exceeds the model's"):
        passkey_eval(tiny_llama, _tiny_tokenizer(), parse_methods("fp16"), [limit + 1], trials=1, progress=False)
