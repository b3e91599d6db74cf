"""Attention where each query reads its most recent keys exact and older ones quantized, in torch alone.

`mixed_attention` is how a windowed method's prefill attends: query position i reads key j's exact copy when
i - j < window and its quantized copy otherwise (kvsqueeze's simulated path, its compressed cache and KIVI all
hold both copies of the tokens a query may see). `attend` is the softmax attention it runs on each chunk of
queries (SDPA, or the soft-capped / learned-sink forms some models use), and `causal_bool_mask` the mask it
starts from. Nothing here imports transformers: a serving engine's process uses it as it is.
"""

from __future__ import annotations

import torch


def causal_bool_mask(attention_mask, q_len: int, k_len: int, device) -> torch.Tensor:
    """Bool mask [B or 1, 1, q_len, k_len] (True = attend) from whatever the mask interface produced."""
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        return attention_mask[..., -k_len:]
    qpos = torch.arange(k_len - q_len, k_len, device=device)
    mask = (torch.arange(k_len, device=device)[None, :] <= qpos[:, None])[None, None]
    if attention_mask is not None:  # additive float mask
        mask = mask & (attention_mask[..., -k_len:] > torch.finfo(attention_mask.dtype).min / 2)
    return mask


SCORE_BUDGET = 1 << 25  # attention scores (floats) materialized per query chunk


def attend(query, keys, values, mask, scaling, softcap=None, sink_logits=None) -> torch.Tensor:
    """Softmax attention [B, Hq, Tq, D] under a bool mask; soft-capped logits (Gemma-2) and a learned sink
    logit per query head (GPT-OSS) as the models' own attention computes them, else SDPA."""
    gqa = query.shape[1] != keys.shape[1]
    if softcap is None and sink_logits is None:
        return torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling,
                                                                enable_gqa=gqa)
    g = query.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(g, dim=1), values.repeat_interleave(g, dim=1)
    scores = query @ k.transpose(-1, -2) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sink_logits is not None:
        extra = sink_logits.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.cat([scores, extra], dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1)
    return probs.to(v.dtype) @ v


_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)  # output and log-sum-exp
BAND = 256  # queries per call of the window's band
GROUPED_ROWS = 64  # queries per query head up to which a KV head's query heads attend as its rows (`_part`)


def _part(query, keys, values, scaling, causal: bool, mask=None):
    """Softmax attention of one part of the keys: output [B, Hq, Tq, D] and its log-sum-exp [B, Hq, Tq] (float32),
    so that parts over disjoint keys combine into the attention over all of them.

    Without a causal mask, queries of up to `GROUPED_ROWS` tokens (a question, a few tokens over a long cache)
    have the G query heads of a KV head attend as G * Tq rows of that one head (mask rows repeated to match),
    reading the keys and values in place instead of copying them G times: the same attention to float rounding
    (the kernel blocks rows by their count), 2-3x faster (`experiments/grouped_heads_part.py`). Longer chunks
    keep the copies: a 256-token bfloat16 prefill chunk gained little alone and ran slower in vLLM's engine."""
    b, hq, tq, d = query.shape
    h = keys.shape[1]
    g = hq // h
    if g > 1 and not causal and tq <= GROUPED_ROWS:
        rows = mask if mask is None else mask.repeat(1, 1, g, 1)  # [B | 1, 1, G * Tq, K], rows g-major as the queries'
        out, lse = _FLASH(query.reshape(b, h, g * tq, d), keys.contiguous(), values.contiguous(), 0.0, False,
                          attn_mask=rows, scale=scaling)[:2]
        return out.reshape(b, hq, tq, d), lse.reshape(b, hq, tq)
    if g > 1:
        keys, values = keys.repeat_interleave(g, dim=1), values.repeat_interleave(g, dim=1)
    return _FLASH(query, keys.contiguous(), values.contiguous(), 0.0, causal, attn_mask=mask, scale=scaling)[:2]


def _mixed_by_parts(query, key, value, kq, vq, scaling, w: int, start: int):
    """`mixed_attention` of a causal mask, as three attentions over disjoint keys merged by their log-sum-exps:
    with the queries at positions p0 + r (p0 = Tk - Tq) and c = p0 - w, query r reads the quantized keys
    j <= c + r, so the quantized keys [0, c] are read by every query (no mask), the next Tq - d ones form a
    square causal block with the queries from r = d on (torch skips its masked half), and the exact keys of its
    window, p - w < j <= p, are a band taken BAND queries at a time. No key is copied per chunk of queries and
    no mask is larger than a band's."""
    b, hq, tq, d = query.shape
    tk = kq.shape[2]
    p0 = tk - tq
    c = p0 - w
    parts = []  # (first query row, output, log-sum-exp)
    if c >= 0:
        parts.append((0, *_part(query, kq[:, :, :c + 1], vq[:, :, :c + 1], scaling, False)))
    j0 = max(0, c + 1)
    first = j0 - c
    if tq - first > 0:
        parts.append((first, *_part(query[:, :, first:], kq[:, :, j0:j0 + tq - first], vq[:, :, j0:j0 + tq - first],
                                    scaling, True)))
    outs, lses = [], []
    for s in range(0, tq, BAND):
        e = min(tq, s + BAND)
        lo, hi = max(start, p0 + s - w + 1), p0 + e  # the exact keys this band's queries read
        gap = torch.arange(p0 + s, p0 + e, device=query.device)[:, None] - torch.arange(lo, hi, device=query.device)
        mask = torch.zeros(gap.shape, dtype=query.dtype, device=query.device)
        mask.masked_fill_((gap < 0) | (gap >= w), float("-inf"))
        o, lse = _part(query[:, :, s:e], key[:, :, lo - start:hi - start], value[:, :, lo - start:hi - start],
                       scaling, False, mask.expand(b, 1, *gap.shape))
        outs.append(o)
        lses.append(lse)
    parts.append((0, torch.cat(outs, dim=2), torch.cat(lses, dim=2)))
    acc = torch.promote_types(query.dtype, torch.float32)  # merged in float32 at least
    total = torch.full((b, hq, tq), float("-inf"), dtype=acc, device=query.device)
    for r, _, lse in parts:
        total[..., r:] = torch.logaddexp(total[..., r:], lse.to(acc))
    out = torch.zeros(b, hq, tq, d, dtype=acc, device=query.device)
    for r, o, lse in parts:
        out[:, :, r:] += (lse.to(acc) - total[..., r:]).exp().unsqueeze(-1) * o.to(acc)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def mixed_attention(query, key, value, kq, vq, attention_mask, scaling, window: int, chunk: int | None = None,
                    softcap: float | None = None, sink_logits=None, start: int = 0):
    """Attention over [B, H, T, D] tensors in which query position i reads key j's exact copy (`key`, `value`)
    when i - j < `window` and its quantized copy (`kq`, `vq`) otherwise; returns [B, Tq, Hq, D].

    The exact copy may hold only the keys from position `start` on (`key[:, :, 0]` is position `start`), as long
    as no query reads an older one exact: `start` at most Tk - Tq - window + 1.

    Query rows are taken in chunks. For the chunk of positions [lo, hi), one SDPA
    call reads the quantized copy of the keys it may see only in quantized form
    (positions up to hi - 1 - window) followed by the exact copy of the keys in
    its fp16 window (positions from lo - window + 1), under a mask that picks,
    for each query, the copy of each key that it sees. Keys no query of the
    chunk can see are left out, so the work is about one causal attention
    instead of two full ones, and the mask and scores stay small.
    """
    b, h, tq, _ = query.shape
    tk = kq.shape[2]
    w = window
    if key.shape[2] != tk - start or start > max(0, tk - tq - w + 1):
        raise ValueError(f"exact keys of positions {start}..{start + key.shape[2] - 1} for {tq} queries over {tk} "
                         f"keys with a window of {w}: they must run to the last key and reach back to the window "
                         "of the first query")
    if attention_mask is None and softcap is None and sink_logits is None and chunk is None and _FLASH is not None \
            and query.device.type == "cpu":
        return _mixed_by_parts(query, key, value, kq, vq, scaling, w, start)
    causal = causal_bool_mask(attention_mask, tq, tk, query.device)  # [B|1, 1, Tq, Tk]
    if chunk is None:
        chunk = max(1, SCORE_BUDGET // max(1, b * h * (tk + w)))
    outs = []
    for s in range(0, tq, chunk):
        e = min(tq, s + chunk)
        lo, hi = tk - tq + s, tk - tq + e  # absolute positions of this chunk's queries
        n_old = max(0, hi - w)  # keys j <= hi - 1 - w: some query of the chunk sees them quantized
        first = max(0, lo - w + 1)  # keys j >= lo - w + 1: some query of the chunk sees them exact
        qpos = torch.arange(lo, hi, device=query.device)[:, None]
        old = (qpos - torch.arange(n_old, device=query.device)[None, :]) >= w
        new = (qpos - torch.arange(first, hi, device=query.device)[None, :]) < w
        mask = torch.cat([causal[..., s:e, :n_old] & old, causal[..., s:e, first:hi] & new], dim=-1)
        mask = mask | ~mask.any(dim=-1, keepdim=True)  # a query that may see nothing (left padding): finite, unused
        keys = torch.cat([kq[:, :, :n_old], key[:, :, first - start:hi - start]], dim=2)
        values = torch.cat([vq[:, :, :n_old], value[:, :, first - start:hi - start]], dim=2)
        outs.append(attend(query[:, :, s:e], keys, values, mask, scaling, softcap, sink_logits))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous(), None
