"""A decode step of the compressed cache waits for the device a fixed number of times, however many layers.

On a GPU every op that needs a tensor's data on the host (an `.item()`, a `nonzero`, a boolean mask, ...)
stalls the CPU until the device has caught up, so a wait per layer caps decode speed. Here the same ops are
counted on the CPU while one decode step runs, on models of 2 and 4 layers: the counts must be the same, and
exactly the waits listed in `EXPECTED`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import random_ids, tiny_model
from kvsqueeze import cache_for
from kvsqueeze.calibrate.collect import collect
from kvsqueeze.calibrate.fit import CalibrationConfig, fit_recipe
from kvsqueeze.integrations.fused import fused_decode
from kvsqueeze.kernels import api as kernels_api
from kvsqueeze.kernels.reference import dequantize_view as reference_dequantize

aten = torch.ops.aten
# ops whose output, or whose output's shape, comes from a tensor's data
READS = {aten._local_scalar_dense, aten.is_nonzero, aten.nonzero, aten.masked_select, aten.allclose, aten.equal,
         aten._unique, aten._unique2, aten.unique_dim, aten.unique_consecutive}
INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}  # a boolean index is a nonzero
HOST_COPIES = {"tolist", "numpy"}  # not ops of the dispatcher: seen as tensor methods

# Each wait left in a decode step, by where it happens:
# - `layers.settle_step`: after the last layer's update, the cache reads once for all layers each layer's
#   largest key or value magnitude (so that a step beyond fp16's range raises before the model returns its
#   logits) and the count of the key outliers its store made room for (so that it keeps room for one step only);
# - `_position_range`: the Triton kernels size their RoPE tables by the largest position, read once per step for
#   the layers that share the positions (it never reaches the reference backend or the dense path).
SETTLE = ("tolist", "integrations/layers.py", "settle_step")
POSITIONS = ("tolist", "kernels/triton/attend.py", "_position_range")
EXPECTED = {"dense": {SETTLE: 1}, "reference": {SETTLE: 1}, "triton": {SETTLE: 1, POSITIONS: 1}}


def _caller() -> tuple[str, str] | None:
    """(file below kvsqueeze/, function) of the innermost frame of kvsqueeze's code, None when it is not on the
    stack."""
    ours = [f for f in traceback.extract_stack() if "/src/kvsqueeze/" in f.filename]
    return (ours[-1].filename.split("/src/kvsqueeze/")[-1], ours[-1].name) if ours else None


class _Reads(TorchDispatchMode):
    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if (packet in READS
                or (packet is aten.repeat_interleave and kwargs.get("output_size") is None
                    and func is not aten.repeat_interleave.self_int)
                or (packet in INDEXING and any(i is not None and i.dtype == torch.bool for i in args[1]))):
            self.counts[(packet.__name__, _caller())] += 1
        return func(*args, **kwargs)


class _Copies(TorchFunctionMode):
    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_COPIES:
            self.counts[(name, _caller())] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def host_waits():
    """Counts, by (op, `_caller()`), what the block reads from tensors on the host: yields the Counter."""
    counts = collections.Counter()
    with _Copies(counts), _Reads(counts):
        yield counts


def test_the_counter_sees_every_kind_of_wait():
    x = torch.arange(6.0)
    mask = x > 2
    cases = [lambda: x[0].item(), lambda: float(x.sum()), lambda: bool(x[1]), lambda: x.nonzero(), lambda: x[mask],
             lambda: x.masked_select(mask), lambda: x.tolist(), lambda: x.numpy(), lambda: torch.allclose(x, x),
             lambda: torch.equal(x, x), lambda: torch.unique(x), lambda: x.long().repeat_interleave(2 * x.long())]
    for case in cases:
        with host_waits() as counts:
            case()
        assert sum(counts.values()) >= 1, case
    with host_waits() as counts:  # shapes that do not depend on the data: nothing to read
        x.long().repeat_interleave(2 * x.long(), output_size=30), torch.where(mask, x, 0), x.cumsum(0), x.topk(2)
    assert not counts


CAL = CalibrationConfig(samples=2, seqlen=64, bits=(2, 3, 4), fractions=(0.0, 0.01))


@functools.cache
def _model(layers: int):
    """A tiny random LLaMA of `layers` layers (the shapes of conftest's) and a recipe calibrated on it."""
    model = tiny_model("llama", seed=0, num_hidden_layers=layers)
    acts = collect(model, random_ids(CAL.samples, CAL.seqlen, seed=5), sinks=1, progress=False)
    return model, fit_recipe(model, acts, CAL, f"tiny-llama-{layers}", "random", progress=False)


def _step_waits(layers: int, method: str, path: str) -> collections.Counter:
    """kvsqueeze's host reads, by (op, file, function), in a decode step of two left-padded rows after a
    prefill of 40 tokens (past the 32-token window of ':r32') and a first decode step, in which a fused cache
    reads its layers' RoPE frequencies (and on a GPU each kernel variant is held once to the reference). path:
    "dense" (the cache's read, then the model's attention), or a fused-decode backend: "reference", or "triton",
    what a GPU runs (its kernels and its encoder; under Triton's interpreter here)."""
    model, recipe = _model(layers)
    ids = random_ids(2, 42, seed=7)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    cache = cache_for(model, recipe, method)
    fused = contextlib.nullcontext() if path == "dense" else fused_decode(model, cache, path)
    with torch.no_grad(), fused:
        model(input_ids=ids[:, :40], attention_mask=mask[:, :40], cache=cache, use_cache=True)
        # and the encoder a GPU store takes, for the steps: triton, or the torch ops where it does not encode the
        # method (':chan' widths); `auto` takes numba on the CPU, whose reads of host arrays wait for nothing
        for layer in cache.layers:
            fused_encoder = path == "triton" and layer.store.k_offsets is None and layer.store.v_offsets is None
            layer.store.encoder = "triton" if fused_encoder else "torch"
        model(input_ids=ids[:, 40:41], attention_mask=mask[:, :41], cache=cache, use_cache=True)
        with host_waits() as counts:
            model(input_ids=ids[:, 41:], attention_mask=mask, cache=cache, use_cache=True)
    cache.close()
    # the model's own reads are not counted (transformers reads whether the padding mask pads, in any cache)
    return collections.Counter({(op, *where): n for (op, where), n in counts.items() if where is not None})


@pytest.mark.parametrize("path", ["dense", "reference", "triton"])
@pytest.mark.parametrize("method", ["nuq3-1%", "nuq@3.49:r32:chan"])
def test_a_decode_step_waits_for_the_device_a_fixed_number_of_times(method, path, monkeypatch):
    # the dense read as a GPU runs it: the reference's dequantization (on the CPU numba's, which reads host arrays
    # that wait for nothing)
    monkeypatch.setattr(kernels_api, "_dequantizer", lambda device_type: reference_dequantize)
    two, four = _step_waits(2, method, path), _step_waits(4, method, path)
    assert two == four, f"waits that grow with the layers: {two} (2 layers) against {four} (4 layers)"
    assert dict(two) == EXPECTED[path], f"waits in a decode step: {dict(two)}"
