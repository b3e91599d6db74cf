"""`evaluate` with a checkpoint: a stopped evaluation resumes after its last finished window and returns what an
uninterrupted one does; a checkpoint of other windows, methods or recipes is refused."""

import pytest
import torch

from kvsqueeze.eval import perplexity as P
from kvsqueeze.methods import parse_methods


def _windows():
    return torch.randint(1, 200, (3, 96), generator=torch.Generator().manual_seed(3))


def test_a_stopped_evaluation_resumes_and_equals_an_uninterrupted_one(tiny_llama, tiny_recipe, tmp_path,
                                                                     monkeypatch):
    specs = parse_methods("fp16,nuq3-1%,q3.5")
    windows = _windows()
    whole = P.evaluate(tiny_llama, windows, specs, tiny_recipe, progress=False)
    ckpt = tmp_path / "cell.safetensors"
    real = P.against_reference
    calls = []

    def stop_in_window_three(*a, **k):
        calls.append(1)
        if len(calls) > 2 * len(specs):
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(P, "against_reference", stop_in_window_three)
    with pytest.raises(KeyboardInterrupt):
        P.evaluate(tiny_llama, windows, specs, tiny_recipe, progress=False, checkpoint=ckpt)
    assert P.checkpoint_windows(ckpt) == 2
    monkeypatch.setattr(P, "against_reference", real)
    forwards = []
    logits = P.window_logits
    monkeypatch.setattr(P, "window_logits", lambda *a: forwards.append(1) or logits(*a))
    resumed = P.evaluate(tiny_llama, windows, specs, tiny_recipe, progress=False, checkpoint=ckpt)
    assert len(forwards) == len(specs)  # the last window alone: its fp16 reference and the two methods
    assert resumed == whole


def test_a_checkpoint_of_other_windows_or_methods_is_refused(tiny_llama, tiny_recipe, tmp_path):
    windows = _windows()
    ckpt = tmp_path / "cell.safetensors"
    P.evaluate(tiny_llama, windows[:2], parse_methods("fp16,nuq3-1%"), tiny_recipe, progress=False, checkpoint=ckpt)
    with pytest.raises(ValueError, match="other windows, methods or recipes"):
        P.evaluate(tiny_llama, windows, parse_methods("fp16,nuq3-1%"), tiny_recipe, progress=False, checkpoint=ckpt)
    with pytest.raises(ValueError, match="other windows, methods or recipes"):
        P.evaluate(tiny_llama, windows[:2], parse_methods("fp16,nuq4-1%"), tiny_recipe, progress=False,
                   checkpoint=ckpt)
    # the same windows and methods over a recipe of other content (calibrated again between the two runs)
    other = type(tiny_recipe)({**tiny_recipe.meta, "tensors_sha256": "0" * 64}, tiny_recipe.tensors)
    with pytest.raises(ValueError, match="other windows, methods or recipes"):
        P.evaluate(tiny_llama, windows[:2], parse_methods("fp16,nuq3-1%"), other, progress=False, checkpoint=ckpt)
    ckpt.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot be read"):
        P.evaluate(tiny_llama, windows[:2], parse_methods("fp16,nuq3-1%"), tiny_recipe, progress=False,
                   checkpoint=ckpt)


def test_window_logits_and_the_divergence_in_pieces_equal_whole_tensor_ops(tiny_llama, tiny_recipe):
    """A window longer than `ROWS` positions is normalised and compared piece by piece (no [T, V] temporaries):
    the values are exactly those of one log_softmax and one KL over the whole window."""
    from kvsqueeze.integrations.simulate import SimulatedQuantization

    assert P.ROWS < 600
    ids = torch.randint(0, tiny_llama.config.vocab_size, (1, 601), generator=torch.Generator().manual_seed(3))
    with SimulatedQuantization(tiny_llama, parse_methods("fp16")[0], tiny_recipe) as sim:
        ref = P.window_logits(tiny_llama, ids, sim)[0]
        whole = tiny_llama(input_ids=ids, cache=sim.new_cache(), use_cache=True).logits[0, :-1].float()
    assert torch.equal(ref, whole.log_softmax(-1))
    with SimulatedQuantization(tiny_llama, parse_methods("nuq3-1%")[0], tiny_recipe) as sim:
        logp = P.window_logits(tiny_llama, ids, sim)[0]
    target = ids[0, 1:]
    nll, kld, top1 = P.against_reference(ref, ref.argmax(-1), logp, target)
    assert torch.equal(kld, (ref.exp() * (ref - logp)).sum(-1).clamp_min(0))
    assert nll == float(-logp.gather(1, target[:, None]).sum())
    assert top1 == int((logp.argmax(-1) == ref.argmax(-1)).sum()) and kld.shape == (600,) and float(kld.sum()) > 0


def test_window_logits_refuses_nan_logits_in_any_piece():
    """A non-finite logit past the first piece is still caught, and the method is named."""
    from types import SimpleNamespace

    class Fake(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, cache, use_cache):
            logits = torch.zeros(1, input_ids.shape[1], 7)
            logits[0, P.ROWS + 5, 3] = float("nan")
            return SimpleNamespace(logits=logits)

    sim = SimpleNamespace(new_cache=lambda: None, spec=SimpleNamespace(name="nuq3-1%"))
    with pytest.raises(FloatingPointError, match="'nuq3-1%' produced NaN/Inf logits"):
        P.window_logits(Fake(), torch.zeros(1, P.ROWS + 20, dtype=torch.long), sim)


def test_window_logits_normalises_the_models_own_float32_logits_in_place():
    """No second [T, V] tensor: the log-probabilities are written over the model's float32 logits."""
    from types import SimpleNamespace

    made = []

    class Fake(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, cache, use_cache):
            made.append(torch.randn(1, input_ids.shape[1], 11, generator=torch.Generator().manual_seed(5)))
            return SimpleNamespace(logits=made[-1])

    sim = SimpleNamespace(new_cache=lambda: None, spec=SimpleNamespace(name="fp16"))
    want = torch.randn(1, P.ROWS + 40, 11, generator=torch.Generator().manual_seed(5))[:, :-1].log_softmax(-1)
    got = P.window_logits(Fake(), torch.zeros(1, P.ROWS + 40, dtype=torch.long), sim)
    assert got.data_ptr() == made[0].data_ptr() and torch.equal(got, want)


def test_a_sliding_model_s_checkpoint_counted_another_way_is_refused(tiny_llama, tiny_recipe, tmp_path,
                                                                     monkeypatch):
    """Bits on sliding-window layers are counted by what the layers hold since storage version 4: a checkpoint of
    a sliding model written under another count is refused; one of a model without sliding layers is not."""
    import transformers
    from transformers import AutoModelForCausalLM

    from kvsqueeze.methods import budget

    cfg = transformers.Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                        query_pre_attn_scalar=256, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    gemma = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    windows, specs = _windows()[:2], parse_methods("fp16,int4")
    for model, recipe, refused in ((gemma, None, True), (tiny_llama, tiny_recipe, False)):
        ckpt = tmp_path / f"{refused}.safetensors"
        monkeypatch.setattr(budget, "STORAGE_VERSION", budget.STORAGE_VERSION - 1)
        first = P.evaluate(model, windows, specs, recipe, progress=False, checkpoint=ckpt)
        monkeypatch.undo()
        if refused:
            with pytest.raises(ValueError, match="other windows, methods or recipes"):
                P.evaluate(model, windows, specs, recipe, progress=False, checkpoint=ckpt)
        else:
            assert P.evaluate(model, windows, specs, recipe, progress=False, checkpoint=ckpt) == first


def test_a_checkpoint_of_another_model_or_dtype_is_refused(tiny_llama, tmp_path):
    """Methods that read no recipe (fp16, int3) over the same token ids on another model with the same tokenizer,
    or the same model in another dtype: the windows would be merged with the other model's."""
    import copy

    windows = _windows()
    specs = parse_methods("fp16,int3")
    ckpt = tmp_path / "cell.safetensors"
    P.evaluate(tiny_llama, windows[:2], specs, None, progress=False, checkpoint=ckpt)
    other = copy.deepcopy(tiny_llama)
    with torch.no_grad():
        next(other.parameters()).add_(1.0)
    with pytest.raises(ValueError, match="other windows, methods or recipes"):
        P.evaluate(other, windows[:2], specs, None, progress=False, checkpoint=ckpt)
    with pytest.raises(ValueError, match="other windows, methods or recipes"):
        P.evaluate(copy.deepcopy(tiny_llama).to(torch.bfloat16), windows[:2], specs, None, progress=False,
                   checkpoint=ckpt)
    assert len(P.evaluate(tiny_llama, windows[:2], specs, None, progress=False, checkpoint=ckpt)) == 2


def test_windows_that_are_not_a_batch_of_ids_within_the_context_are_refused(tiny_llama, tiny_recipe):
    """A 1-D tensor of ids (crashed deep inside), windows of one token, and windows longer than the model's
    context (scored silently before) get an error that names the fix."""
    specs = parse_methods("fp16")
    ids = _windows()
    with pytest.raises(ValueError, match=r"\[W windows, T >= 2 tokens\], got \(96,\)"):
        P.evaluate(tiny_llama, ids[0], specs, tiny_recipe, progress=False)
    with pytest.raises(ValueError, match="T >= 2 tokens"):
        P.evaluate(tiny_llama, ids[:, :1], specs, tiny_recipe, progress=False)
    limit = tiny_llama.config.max_position_embeddings
    long = torch.randint(1, 200, (1, limit + 1), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=f"longer than the model's {limit}-token context"):
        P.evaluate(tiny_llama, long, specs, tiny_recipe, progress=False)
