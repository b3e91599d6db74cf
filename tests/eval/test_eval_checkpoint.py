"""`evaluate` with a checkpoint: a stopped evaluation resumes after its last finished window and returns what an
uninterrupted one does; a checkpoint of other windows or methods is refused."""

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
    with pytest.raises(ValueError, match="other windows or methods"):
        P.evaluate(tiny_llama, windows, parse_methods("fp16,nuq3-1%"), tiny_recipe, progress=False, checkpoint=ckpt)
    with pytest.raises(ValueError, match="other windows or methods"):
        P.evaluate(tiny_llama, windows[:2], parse_methods("fp16,nuq4-1%"), tiny_recipe, progress=False,
                   checkpoint=ckpt)
    ckpt.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot be read"):
        P.evaluate(tiny_llama, windows[:2], parse_methods("fp16,nuq3-1%"), tiny_recipe, progress=False,
                   checkpoint=ckpt)
