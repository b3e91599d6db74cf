"""Measured sensitivities for bit budgets: the loss each layer's keys or values cost at each choice.

`kvsqueeze budget` runs this and stores the table in the recipe; `nuq@AVG:kl` methods read it
(`kvsqueeze.methods.budget`).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from tqdm.auto import tqdm

from ..methods.budget import _options, unit_key
from ..integrations.simulate import SimulatedQuantization
from ..methods import parse_method
from ..methods import build_quantizers
from ..recipe import Recipe
from ..shape import kv_shape


class _Skip(torch.nn.Module):
    """Stands in for a decoder layer whose output is known: returns its input unchanged."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def measure_sensitivity(model, recipe: Recipe, windows, sinks: int = 1, fractions: tuple[float, ...] | None = None,
                        bits: tuple[int, ...] | None = None, progress: bool = True, skip_layers: bool = True) -> dict:
    """The KL divergence from the fp16 cache's next-token distribution, per token, on calibration windows
    [W, T], when one tensor of one layer is quantized with one choice and every other stays exact: the
    measured loss of each (layer, tensor, choice), the table ':kl' budgets read (stored under
    `recipe.meta["sensitivity"]`). Errors of separate tensors add to first order, as the budget assumes.

    Layers before the quantized one see exactly what the fp16 run saw, so their outputs are taken from it
    (where the model keeps its decoder layers in `model.model.layers`, and only once a run that skips them
    has given the fp16 logits back exactly; otherwise every run is a whole forward). `bits` and `fractions`: the
    widths and outlier fractions to measure (default: all the recipe has); a ':kl' budget scales each unit by
    the choices measured (`budget.measured_scales`). `skip_layers=False`: whole forwards."""
    shape = kv_shape(model.config)
    device = next(model.parameters()).device
    windows = windows.to(device)
    blocks = getattr(getattr(model, "model", None), "layers", None)
    if not skip_layers or not isinstance(blocks, torch.nn.ModuleList) or len(blocks) != shape.layers:
        blocks = None  # every run is a whole forward
    inputs: list = [None] * shape.layers

    def keep_input(i):
        def hook(module, args, kwargs):
            inputs[i] = args[0] if args else kwargs["hidden_states"]
        return hook

    handles = [b.register_forward_pre_hook(keep_input(i), with_kwargs=True) for i, b in enumerate(blocks or [])]
    try:
        with torch.no_grad(), SimulatedQuantization(model, parse_method("fp16"), None) as sim:
            ref = model(input_ids=windows, cache=sim.new_cache(), use_cache=True).logits.float().log_softmax(-1)
    finally:
        for h in handles:
            h.remove()
    ref_p = ref.exp()

    def run(layer: int, sim) -> torch.Tensor:
        if blocks is None or not skipping[0]:
            return model(input_ids=windows, cache=sim.new_cache(), use_cache=True).logits
        saved = list(blocks[:layer])
        for i in range(layer):
            blocks[i] = _Skip()

        def start(module, args, kwargs):  # the quantized layer starts from the fp16 run's input
            if args:
                return (inputs[layer], *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": inputs[layer]}

        handle = blocks[layer].register_forward_pre_hook(start, with_kwargs=True)
        try:
            return model(input_ids=windows, cache=sim.new_cache(), use_cache=True).logits
        finally:
            handle.remove()
            for i, block in enumerate(saved):
                blocks[i] = block

    options = _options(recipe, bits, fractions)
    if not options:
        calibrated = _options(recipe)
        raise ValueError(f"no calibrated choice of the recipe is among bits {bits} and outlier fractions {fractions}: "
                         f"it was calibrated with {sorted({c.bits for c in calibrated})} bits and fractions "
                         f"{sorted({c.fraction for c in calibrated})}")
    spec = parse_method(f"nuq4:sink{sinks}")
    table: dict[str, float] = {}
    jobs = [(layer, kv, c) for layer in range(shape.layers) for kv in ("k", "v") for c in options]
    skipping = [blocks is not None]
    with torch.no_grad(), SimulatedQuantization(model, spec, recipe) as sim:
        if skipping[0]:  # skipping must give the fp16 run's logits back, or every run is a whole forward
            sim.k_pre, sim.v = [None] * shape.layers, [None] * shape.layers
            again = run(shape.layers - 1, sim).float().log_softmax(-1)
            skipping[0] = again.shape == ref.shape and torch.allclose(again, ref, atol=1e-4, rtol=1e-4)
        done: dict[tuple, float] = {}
        for layer, kv, c in tqdm(jobs, desc="sensitivity", unit="run", disable=not progress):
            chosen = dataclasses.replace(spec, k_bits=c.bits, v_bits=c.bits, outlier_fraction=c.fraction)
            quant = build_quantizers(chosen, recipe, layer, shape.channels)[0 if kv == "k" else 1]
            # per-token values at a fraction that keeps no outlier are the same quantizer as without outliers
            same = (layer, kv, c.bits, quant.fixed_outliers(shape.channels) or 0) if kv == "v" else None
            if same in done:
                table[unit_key(layer, kv, c)] = done[same]
                continue
            sim.k_pre = [quant if (i == layer and kv == "k") else None for i in range(shape.layers)]
            sim.v = [quant if (i == layer and kv == "v") else None for i in range(shape.layers)]
            logp = run(layer, sim).float().log_softmax(-1)
            kl = float((ref_p * (ref - logp)).sum(-1).mean())
            if not math.isfinite(kl):
                raise FloatingPointError(f"layer {layer} {kv.upper()} at {c.label()}: the KL divergence from the "
                                         f"unquantized model is {kl}; check the model's outputs are finite")
            kl = max(kl, 0.0)  # a divergence is never below 0; float32 rounding can put a negligible one just under
            table[unit_key(layer, kv, c)] = kl
            if same is not None:
                done[same] = kl
    return {"windows": int(windows.shape[0]), "seqlen": int(windows.shape[1]), "sinks": sinks,
            "skipped_unchanged_layers": skipping[0],
            "bits": sorted({c.bits for c in options}), "fractions": sorted({c.fraction for c in options}), "kl": table}
