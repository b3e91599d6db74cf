"""What the Fisher pass refuses: activations float16 cannot hold, layers the loss does not depend on, and
sensitivities a recipe could not load."""

import pytest
import torch

from conftest import random_ids, tiny_model
from kvsqueeze.calibrate.collect import collect


def test_activations_beyond_float16_are_named_not_stored_as_inf():
    """Values scaled by 3e4 and the output projection by 1/3e4 leave the model's outputs as they were, and its
    values past float16's range: stored as inf, they made the fit's objectives NaN, refused only at save as a
    JSON error naming neither the layer nor the cause."""
    model = tiny_model("llama", seed=0)
    attn = model.model.layers[1].self_attn
    with torch.no_grad():
        attn.v_proj.weight.mul_(3e4)
        attn.o_proj.weight.div_(3e4)
    with pytest.raises(FloatingPointError, match=r"layer 1 values reach .* beyond float16's range"):
        collect(model, random_ids(2, 32, seed=1), sinks=1, progress=False)


def test_a_layer_the_loss_does_not_depend_on_is_named():
    """A zero output projection makes the layer's keys and values irrelevant to the loss: their Fisher weights
    are all zero and no codebook can be weighted by them; the error names the layer, not a histogram."""
    model = tiny_model("llama", seed=0)
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight.zero_()
    with pytest.raises(FloatingPointError, match=r"layer 1 keys: the Fisher information is zero"):
        collect(model, random_ids(2, 32, seed=1), sinks=1, progress=False)


def test_windows_must_leave_two_tokens_after_the_sinks():
    model = tiny_model("llama", seed=0)
    with pytest.raises(ValueError, match="the last one carries no gradient: give windows of at least 3 tokens"):
        collect(model, random_ids(2, 2, seed=1), sinks=1, progress=False)


def test_the_fisher_pass_runs_without_dropout_and_restores_the_mode():
    """A model handed over in training mode with dropout gives the same statistics as in eval mode."""
    model = tiny_model("llama", seed=0, attention_dropout=0.5)
    ids = random_ids(2, 32, seed=1)
    model.eval()
    ref = collect(model, ids, sinks=1, progress=False)
    model.train()
    got = collect(model, ids, sinks=1, progress=False)
    assert model.training
    for a, b in zip(ref.keys + ref.values, got.keys + got.values):
        assert torch.equal(a, b)


def test_a_sensitivity_just_below_zero_is_stored_as_zero():
    """A layer that barely matters measures a KL of about -1e-8 in float32; stored as is, the recipe saved and
    then refused to load. Stored as 0, it round-trips."""
    from kvsqueeze.calibrate.fit import CalibrationConfig, fit_recipe
    from kvsqueeze.calibrate.sensitivity import measure_sensitivity

    model = tiny_model("llama", seed=0)
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight.mul_(1e-6)
    acts = collect(model, random_ids(4, 64, seed=1), sinks=1, progress=False)
    recipe = fit_recipe(model, acts, CalibrationConfig(samples=4, seqlen=64, bits=(3,), fractions=(0.0, 0.01)),
                        "tiny", "random", progress=False)
    table = measure_sensitivity(model, recipe, random_ids(1, 48, seed=2), bits=(3,), fractions=(0.0,),
                                progress=False)
    assert all(v >= 0 for v in table["kl"].values())
    assert min(table["kl"][k] for k in table["kl"] if k.startswith("1.")) < 1e-6
