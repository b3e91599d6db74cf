"""Collect calibration activations and their Fisher information (KVQuant Section 3.3).

For every layer we keep the pre-RoPE keys (the tensor the model hands its
rotary step: `k_norm` or `k_proj` output), the values (`v_proj` output) and F = (dLoss/dA)^2, the diagonal Fisher information of each
activation, from teacher-forced forward/backward passes of the language-model
loss. Only activation gradients are computed (weights are frozen). Sink tokens
are dropped here so they never shape a statistic. Activations are stored in
fp16 and Fisher values in bfloat16 (squared gradients underflow fp16).

A float16 model is calibrated in float32: its float16 weights are cast to
float32 for the passes (exactly: every float16 number is a float32 one) and
back afterwards, bit for bit, because float16 gradients of a language-model
loss underflow and their squares would leave Fisher weights of zero.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..numerics.affine import check_finite
from ..integrations.parts import attention_modules, hook_projections
from ..integrations.preflight import preflight
from ..shape import kv_shape


@dataclass
class Activations:
    """Per layer [N, C] matrices over N calibration tokens (sinks excluded)."""

    keys: list[torch.Tensor]  # pre-RoPE, fp16
    values: list[torch.Tensor]  # fp16
    key_fisher: list[torch.Tensor]  # bf16
    value_fisher: list[torch.Tensor]  # bf16
    positions: torch.Tensor  # [N] absolute position of each row, for re-applying RoPE
    loss: float  # mean LM loss over the calibration samples
    seconds: float


def collect(model, samples: torch.Tensor, sinks: int = 1, progress: bool = True) -> Activations:
    """Run forward + backward on each sample [S, T] and gather K, V and their Fisher information."""
    preflight(model)  # before minutes of forward and backward passes
    with _float16_as_float32(model):
        return _collect(model, samples, sinks, progress)


class _float16_as_float32:
    """Cast a model's float16 parameters and buffers to float32 inside the block, and back (both exact)."""

    def __init__(self, model):
        self.tensors = [t for t in (*model.parameters(), *model.buffers()) if t.dtype == torch.float16]

    def __enter__(self):
        for t in self.tensors:
            t.data = t.data.float()

    def __exit__(self, *exc):
        for t in self.tensors:
            t.data = t.data.half()


def _collect(model, samples: torch.Tensor, sinks: int, progress: bool) -> Activations:
    shape = kv_shape(model.config)
    s, t = samples.shape
    if t - sinks < 2:  # a window's last token carries no gradient: nothing after it has a label
        raise ValueError(f"calibration windows of {t} tokens leave {max(0, t - sinks)} after {sinks} sink token(s), "
                         f"and the last one carries no gradient: give windows of at least {sinks + 2} tokens")
    attn = attention_modules(model)
    n = s * (t - sinks)
    keys = [torch.empty(n, shape.channels, dtype=torch.float16) for _ in attn]
    values = [torch.empty_like(k) for k in keys]
    kf = [torch.empty(n, shape.channels, dtype=torch.bfloat16) for _ in attn]
    vf = [torch.empty_like(f) for f in kf]
    captured: dict[tuple[int, str], torch.Tensor] = {}

    def keep(layer: int, kind: str, output: torch.Tensor) -> torch.Tensor:
        # A copy that replaces the output, so that its gradient flows even where the hook is handed a view
        # (a fused projection's key slice, a transposed per-head norm output).
        kept = output.clone()
        kept.retain_grad()
        captured[(layer, kind)] = kept
        return kept

    handles = hook_projections(model, keep)
    was_training = model.training
    flags = [p.requires_grad for p in model.parameters()]
    model.requires_grad_(False)
    embed = model.get_input_embeddings()
    t0 = time.perf_counter()
    total_loss = 0.0
    try:
        model.eval()  # no dropout in the Fisher passes (the mode is restored below)
        for j in tqdm(range(s), desc="fisher", unit="seq", disable=not progress):
            ids = samples[j : j + 1].to(embed.weight.device)
            captured.clear()
            emb = embed(ids).detach().requires_grad_(True)
            out = model(inputs_embeds=emb, labels=ids, use_cache=False)
            if not torch.isfinite(out.loss):
                raise FloatingPointError(f"calibration sample {j} gives a NaN/Inf loss; check the model and text")
            out.loss.backward()
            total_loss += float(out.loss.detach())
            rows = slice(j * (t - sinks), (j + 1) * (t - sinks))
            for i in range(len(attn)):
                k, v = captured[(i, "k")], captured[(i, "v")]
                check_finite(k, f"layer {i} keys")
                check_finite(v, f"layer {i} values")
                if k.grad is None or v.grad is None:
                    raise ValueError(f"layer {i}: the loss does not depend on its "
                                     f"{'keys' if k.grad is None else 'values'} (a layer that reads another's KV "
                                     "cache?); this model cannot be calibrated layer by layer")
                kg, vg = k.grad.flatten(2), v.grad.flatten(2)  # [1, T, C] (a per-head k_norm gives [1, T, H, D])
                k, v = k.detach().flatten(2), v.detach().flatten(2)
                keys[i][rows] = k[0, sinks:].half()
                values[i][rows] = v[0, sinks:].half()
                for name, kept in (("keys", keys[i][rows]), ("values", values[i][rows])):
                    if not torch.isfinite(kept).all():  # finite in float32, past float16's 65,504 once stored
                        raise FloatingPointError(
                            f"layer {i} {name} reach {float(captured[(i, name[0])].detach().abs().max()):.4g} on "
                            f"calibration sample {j}, beyond float16's range (65,504) that the cache stores them "
                            "in (sinks, outliers, the fp16 window); this model's KV cache cannot be quantized here")
                kf[i][rows] = kg[0, sinks:].float().square().bfloat16()
                vf[i][rows] = vg[0, sinks:].float().square().bfloat16()
    finally:
        for h in handles:
            h.remove()
        for p, f in zip(model.parameters(), flags):
            p.requires_grad_(f)
        model.train(was_training)
    for i in range(len(attn)):
        for name, fisher in (("keys", kf[i]), ("values", vf[i])):
            if not fisher.float().sum() > 0:
                raise FloatingPointError(f"layer {i} {name}: the Fisher information is zero on every calibration "
                                         "token (the loss does not depend on them), so no codebook can be weighted "
                                         "by it; check the layer's weights, or calibrate on longer windows")
    positions = torch.arange(sinks, t).repeat(s)
    return Activations(keys, values, kf, vf, positions, total_loss / s, time.perf_counter() - t0)
