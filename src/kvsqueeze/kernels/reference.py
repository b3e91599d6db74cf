"""Reference backend of `decode_attention`: dequantize the whole cache with torch ops, then softmax attention.

Plain and slow on purpose; it is the oracle the fast backends are tested
against and runs on any device. The reconstruction is the store's own
(`KVStore.dequantize` reads the same view through `dequantize_view`): element =
level[code] * scale + zero in float32; each outlier replaces the element at its
channel; each sink replaces its whole slot. Then RoPE at the tokens' positions
(`kvsqueeze.numerics.rope`) and attention.
"""

from __future__ import annotations

import torch

from ..numerics.affine import dequantize
from ..numerics.packing import unpack_codes, unpack_mixed
from ..numerics.rope import Rope
from .view import NO_CHANNEL, Outliers, StoreView


def _replace_outliers(dense: torch.Tensor, sparse: Outliers | None, spare: int) -> None:
    """Overwrite dense [T*B, C] at the outliers' (slot, channel) with their fp16 values (sparse trimmed).

    Entries past pointers[slots], room a decode step left (`TokenOutliers.append_unsettled`), and empty entries
    (`NO_CHANNEL`) write row `spare`."""
    if sparse is None or sparse.nnz == 0:
        return
    ptr = sparse.pointers.long()  # [slots + 1]
    entry = torch.arange(sparse.nnz, device=dense.device)
    slot = torch.searchsorted(ptr, entry, right=True) - 1  # the last slot starting at or before the entry
    channel = sparse.channels.long() & 0xFFFF
    real = (entry < ptr[-1:]) & (channel != NO_CHANNEL)
    dense[torch.where(real, slot, spare), torch.where(real, channel, 0)] = sparse.values.float()


def _unpack(words: torch.Tensor, bits: int, offsets: torch.Tensor | None, channels: int) -> torch.Tensor:
    return unpack_codes(words, bits, channels) if offsets is None else unpack_mixed(words, offsets, check=False)


def dequantize_view(kv: StoreView) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys (pre-RoPE) and values of every slot, float32 [T, B, C] each."""
    kv = kv.trim()
    t, b, c = kv.tokens, kv.batch, kv.channels
    # one spare token [T + 1, B, C]: what is no outlier and no sink (room left past the outliers, empty sink
    # entries) is written there, so that no shape depends on how many there are and nothing waits for the device
    def spare(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x.new_zeros(1, *x.shape[1:])])

    k_codes = _unpack(spare(kv.k_codes), kv.k_bits, kv.k_offsets, c)  # [T + 1, B, C]
    v_codes = _unpack(spare(kv.v_codes), kv.v_bits, kv.v_offsets, c)
    sz = spare(kv.v_scale_zero).float()  # [T + 1, B, 2]
    k = dequantize(k_codes, kv.k_scale.float(), kv.k_zero.float(), kv.k_levels.float())
    v = dequantize(v_codes, sz[..., :1], sz[..., 1:], kv.v_levels.float())
    _replace_outliers(k.view(-1, c), kv.k_outliers, t * b)
    _replace_outliers(v.view(-1, c), kv.v_outliers, t * b)
    slots = torch.where(kv.sink_slot >= 0, kv.sink_slot.long(), t)  # [B, S]
    rows = torch.arange(b, device=slots.device)[:, None].expand_as(slots)
    k[slots, rows] = kv.sink_k.float()
    v[slots, rows] = kv.sink_v.float()
    return k[:t], v[:t]


def decode_attention(q: torch.Tensor, kv: StoreView, rope: Rope, scaling: float,
                     key_mask: torch.Tensor | None, softcap: float | None = None,
                     sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """See `kvsqueeze.kernels.decode_attention`; q float32 [B, Hq, D] -> float32 [B, Hq, D]."""
    bsz, hq, d = q.shape
    h, t = kv.heads, kv.tokens
    g = hq // h
    k, v = dequantize_view(kv)  # [T, B, C]
    k = k.view(t, bsz, h, d).permute(1, 2, 0, 3)  # [B, H, T, D]
    v = v.view(t, bsz, h, d).permute(1, 2, 0, 3)
    k = rope.apply(k, kv.positions[:t].t()[:, None])  # turned at each token's position
    qg = q.view(bsz, h, g, d)  # query head h * G + j reads KV head h
    scores = torch.einsum("bhgd,bhtd->bhgt", qg, k) * scaling  # [B, H, G, T]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    if sink_logits is not None:  # one more logit per query head, with no value
        extra = sink_logits.float().to(scores.device).view(1, h, g, 1).expand(bsz, h, g, 1)
        probs = torch.cat([scores, extra], dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1)
    return torch.einsum("bhgt,bhtd->bhgd", probs, v).reshape(bsz, hq, d)
