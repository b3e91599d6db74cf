"""The compressed KV cache in fixed-size pages: the same bytes for every token, so a paged allocator can hold it.

A serving engine (vLLM) hands each layer one flat buffer of `num_blocks` pages of `block_size` tokens, and each
sequence a block table naming its pages. `PageLayout` packs KVQuant's cache (Hooper et al., arXiv 2401.18079) into
such pages with a fixed number of bytes per token:

* key codes: pre-RoPE keys against the recipe's per-channel range and codebook, `k_bits` per element, packed
  along channels (`numerics/packing.py`), int32 words;
* key outliers: a fixed budget of `key_slots` exact fp16 values per token with their 16-bit channel. The store of
  the HF path keeps every element outside the calibrated per-channel range, a count that varies from token to
  token; a page cannot. Each token keeps instead the `key_slots` elements its codes reconstruct worst: every
  outlier while it has at most `key_slots` of them (a clipped outlier's error is its distance past the range,
  and the slots left hold the in-range elements that lose most to rounding), the farthest ones when it has more.
  For a token with at most `key_slots` outliers the reconstruction error is therefore never larger than the
  HF store's; `overflow` in `write` counts the outliers a token had to clip;
* value codes with their fp16 scale and zero-point per token, and the exact per-token top-k value outliers (a
  fixed count already: the method's own);
* the sinks: the first `sinks` positions of a sequence, fp16 pre-RoPE keys and values, in a sink area every
  page carries (a sequence's first page uses it; `sinks` is at most `block_size`).

Page regions, each aligned to 16 bytes, in this order: k_codes int32 [bs, Wk], v_codes int32 [bs, Wv], v_scale_zero
fp16 [bs, 2], k_channels int16 [bs, key_slots], k_values fp16 [bs, key_slots], v_channels int16 [bs, vk], v_values
fp16 [bs, vk], sink_k fp16 [S, C], sink_v fp16 [S, C]. Slot n of the buffer is token n % bs of page n // bs.

`view` gathers the pages of a batch of sequences into the `StoreView` the decode kernels read (`kernels.view`):
every kernel, the numba one on CPU and the Triton ones on GPU, then attends over paged memory as over the HF
cache's store. `read` dequantizes one sequence straight from its pages (what a prefill chunk attends).

A rank's share (`heads`): under tensor parallelism each rank holds some of a layer's KV heads. Its pages hold the
codes and sinks of its heads' channels only, and each token's value scale and zero-point and its whole fixed count of
key and value slots, as the full layout would write them from the whole token: `write` takes the keys and values of
every head (what the ranks exchange), encodes them as the full layout does, and keeps its share, so that a rank's
codes are bit for bit the matching channels of the full layout's. A slot whose element lies in another rank's
heads holds `NO_CHANNEL` (and a zero value), which every reader skips.

Two implementations do the page work: torch ops (any device; the reference) and, for pages in CPU memory, the
numba kernels of `kvsqueeze.kernels.numba.pages` (one pass per token instead of dozens of small torch ops,
which is what a serving engine's every layer and step pays for). They write the same bytes and read the same
floats. `kernels="auto"` takes numba for CPU pages where it loads (and warns once where it cannot).
Nothing here needs transformers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from ..kernels.view import ARRAYS, NO_CHANNEL, Outliers, Rows, StoreView
from ..methods.budget import check_widths
from ..numerics.affine import FP16_MAX
from ..numerics.packing import OUTLIER_CODE, code_offsets, mixed_words, pack_codes, pack_mixed, words_per_vector
from ..numerics.quantizer import VectorQuantizer

ALIGN = 16


KERNELS = ("auto", "torch", "numba")


@functools.cache
def _numba_pages():
    """`kvsqueeze.kernels.numba.pages`, or None where numba cannot load (warned once)."""
    try:
        from ..kernels.numba import pages
    except ImportError as exc:
        warnings.warn(f"the numba page kernels cannot be loaded ({exc}); pages are written and read with torch "
                      "ops, which is much slower. Ask for kernels='numba' to see the full error", RuntimeWarning,
                      stacklevel=3)
        return None
    return pages


def _numpy(x: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (strided as it is); 16-bit floats as uint16 bits, int32 as uint32."""
    if x.dtype in (torch.float16, torch.bfloat16, torch.int16):
        return x.view(torch.int16).numpy().view(np.uint16)
    if x.dtype == torch.int32:
        return x.numpy().view(np.uint32)
    return x.numpy()


def _up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class Region:
    name: str
    offset: int  # bytes from the page start
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]  # of one page's region, in `dtype` elements


def regions(channels: int, k_words: int, v_words: int, key_slots: int, value_slots: int, sinks: int,
            block_size: int) -> dict[str, Region]:
    """Where each part of a page lies (see the module docstring); every region starts on 16 bytes. `k_words`,
    `v_words`: int32 words of one token's key and value codes (`code_words`)."""
    bs, c = block_size, channels
    specs = [("k_codes", torch.int32, (bs, k_words)),
             ("v_codes", torch.int32, (bs, v_words)),
             ("v_scale_zero", torch.float16, (bs, 2)),
             ("k_channels", torch.int16, (bs, key_slots)), ("k_values", torch.float16, (bs, key_slots)),
             ("v_channels", torch.int16, (bs, value_slots)), ("v_values", torch.float16, (bs, value_slots)),
             ("sink_k", torch.float16, (sinks, c)), ("sink_v", torch.float16, (sinks, c))]
    out, offset = {}, 0
    for name, dtype, shape in specs:
        nbytes = shape[0] * shape[1] * torch.empty(0, dtype=dtype).element_size()
        out[name] = Region(name, offset, nbytes, dtype, shape)
        offset += _up(nbytes)
    return out


def _channels_of(q: VectorQuantizer, c0: int, c1: int) -> VectorQuantizer:
    """q cut to channels c0 .. c1 (per-channel ranges and widths): what a share's codes are read with."""
    cut = lambda t: None if t is None else t[c0:c1]  # noqa: E731
    return dataclasses.replace(q, lo=cut(q.lo), hi=cut(q.hi), widths=cut(q.widths))


def code_words(q: VectorQuantizer, channels: int) -> int:
    """int32 words one token's codes of `q` take in a page."""
    return words_per_vector(channels, q.bits) if q.widths is None else mixed_words(q.stream_offsets(channels))


def page_bytes(parts: dict[str, Region], block_size: int) -> int:
    """A page's size: its regions, rounded up to a whole number of bytes per token and of 16-byte units."""
    end = max(r.offset + _up(r.nbytes) for r in parts.values())
    return _up(end, math.lcm(ALIGN, block_size))


class PageLayout:
    """How one layer's tokens sit in pages; see the module docstring.

    Args:
        k_quant: per-channel key quantizer (offline range), `axis="channel"`.
        v_quant: per-token value quantizer with a fixed outlier count (or none), `axis="token"`.
        channels: C = kv_heads * head_dim.
        head_dim: D.
        block_size: tokens per page.
        sinks: leading positions of each sequence kept exactly in fp16 (at most `block_size`).
        kernels: "auto" (numba for pages in CPU memory where it loads, else torch), "torch" or "numba".
        heads: (first, count): the KV heads this layout holds of the channels // head_dim the quantizers cover (a
            tensor-parallel rank's share; see the module docstring); None: all of them.
        min_page_bytes: pages of at least this many bytes (a multiple of 16 and of the block size: the shares of
            a budget whose channels differ in width differ in size, and every rank's pages must be of one size).

    `channels` and `heads` of the layout are then its share's, `full_channels` the method's.
    """

    def __init__(self, k_quant: VectorQuantizer, v_quant: VectorQuantizer, channels: int, head_dim: int,
                 block_size: int, sinks: int = 0, kernels: str = "auto", heads: tuple[int, int] | None = None,
                 min_page_bytes: int = 0):
        problems = []
        first, count = (0, channels // head_dim if head_dim > 0 else 0) if heads is None else heads
        if head_dim > 0 and not (0 <= first and 0 < count and (first + count) * head_dim <= channels):
            problems.append(f"heads {heads} is not a share of the {channels // head_dim} KV heads of width {head_dim}")
        if kernels not in KERNELS:
            problems.append(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
        key_slots = k_quant.slots if k_quant.fraction > 0 else 0
        if k_quant.axis != "channel" or v_quant.axis != "token" or v_quant.group:
            problems.append("pages hold per-channel pre-RoPE keys and per-token values (KVQuant's axes)")
        if v_quant.fraction > 0 and v_quant.fixed_outliers(channels) is None:
            problems.append("value outliers must be a fixed count per token (per-token top-k, scope 'vector')")
        if channels % head_dim or head_dim % 2:
            problems.append(f"{channels} channels are not a whole number of even heads of width {head_dim}")
        if not 0 <= sinks <= block_size:
            problems.append(f"sinks ({sinks}) must fit in a sequence's first page of {block_size} tokens")
        if k_quant.fraction > 0 and not 0 < key_slots <= channels:
            problems.append(f"a page holds a fixed number of exact key elements per token: give the key quantizer "
                            f"1 to {channels} slots (a method with ':kslotsN', e.g. 'nuq3-1%:kslots6')")
        if channels >= NO_CHANNEL:
            problems.append(f"{channels} channels: outlier channel indices are 16 bits, {NO_CHANNEL} meaning none")
        for name, q in (("key", k_quant), ("value", v_quant)):
            if q.widths is not None:
                check_widths(q.widths.tolist(), f"PageLayout {name}s")
            if q.widths_problem(channels):
                problems.append(f"{name}s: {q.widths_problem(channels)}")
        if problems:
            raise ValueError("PageLayout: " + "; ".join(problems))
        self.k_quant, self.v_quant = k_quant, v_quant  # the whole method's: `write` encodes whole tokens with them
        self.full_channels, self.first_channel = channels, first * head_dim
        self.channels, self.head_dim, self.heads = count * head_dim, head_dim, count
        c0, c1 = self.first_channel, self.first_channel + self.channels
        # what the share's pages are read with: the quantizers cut to its channels (ranges, widths)
        self._k_share, self._v_share = (q if heads is None else _channels_of(q, c0, c1) for q in (k_quant, v_quant))
        self.block_size, self.key_slots, self.sinks = block_size, key_slots, sinks
        self.k_bits, self.v_bits = k_quant.bits, v_quant.bits
        self.value_slots = (v_quant.fixed_outliers(channels) or 0) if v_quant.fraction > 0 else 0
        from ..numerics.affine import choose_qparams

        scale, zero = choose_qparams(k_quant.lo.view(1, -1), k_quant.hi.view(1, -1))
        self.k_scale, self.k_zero = scale.view(-1)[c0:c1].half(), zero.view(-1)[c0:c1].half()
        # channels with widths of their own (`nuq@AVG:chan`): one bit stream of every width, as the HF store packs it
        self.k_offsets, self.v_offsets = (None if q.widths is None else code_offsets(q.widths.cpu())
                                          for q in (self._k_share, self._v_share))
        self.regions = regions(self.channels, code_words(self._k_share, self.channels),
                               code_words(self._v_share, self.channels), key_slots, self.value_slots, sinks,
                               block_size)
        self.page_bytes = max(page_bytes(self.regions, block_size), min_page_bytes)
        if self.page_bytes % math.lcm(ALIGN, block_size):
            raise ValueError(f"PageLayout: min_page_bytes {min_page_bytes} is not a multiple of 16 bytes and of the "
                             f"block size {block_size}")
        self.kernels = kernels
        if kernels == "numba":
            from ..kernels.numba import pages  # noqa: F401  asked for by name: its own import error

    def _fast(self, pages: torch.Tensor):
        """The numba page kernels where they do this buffer's work, else None (torch ops)."""
        if self.kernels == "torch" or pages.device.type != "cpu":
            if self.kernels == "numba":
                raise ValueError(f"kernels='numba' works on pages in CPU memory, these are on {pages.device}")
            return None
        if self.kernels == "numba":
            from ..kernels.numba import pages as fast

            return fast
        return _numba_pages()

    @functools.cached_property
    def _tables(self) -> dict[str, np.ndarray]:
        """What the numba kernels read of the quantizers, numpy (computed as the torch path does): per channel, the
        codebook midpoints float32 [M, C] (+inf past a channel's own, as `affine.quantize`'s boundaries), the
        levels float32 [C, L] and the codes' stream bit offsets int64 [C + 1]; the key range, scale, zero [C]."""
        from ..numerics.affine import choose_qparams

        c, c0, c1 = self.full_channels, self.first_channel, self.first_channel + self.channels
        kq, vq = self.k_quant, self.v_quant
        k_scale, k_zero = choose_qparams(kq.lo.view(1, -1), kq.hi.view(1, -1))
        f = lambda x: np.ascontiguousarray(x.detach().float().cpu().numpy())  # noqa: E731

        def per_channel(q: VectorQuantizer) -> tuple[np.ndarray, np.ndarray]:
            mids = q.channel_midpoints(c)[0].t()  # [M, C]: the kernel's inner loop runs over channels
            levels = q.decode_levels.float().cpu()
            levels = levels.view(1, -1).expand(c, -1) if levels.dim() == 1 else levels
            return f(mids), f(levels)

        k_mids, k_levels = per_channel(kq)
        v_mids, v_levels = per_channel(vq)
        # the share's codes are packed (and read) as a stream of its own channels
        offs = lambda q: np.ascontiguousarray(q.stream_offsets(c1 - c0).numpy())  # noqa: E731
        return {"k_mids": k_mids, "k_levels": k_levels, "k_offs": offs(self._k_share), "k_scale": f(k_scale.view(-1)),
                "k_zero": f(k_zero.view(-1)), "k_lo": f(kq.lo.view(-1)), "k_hi": f(kq.hi.view(-1)), "v_mids": v_mids,
                "v_levels": v_levels, "v_offs": offs(self._v_share), "k_scale_read": f(self.k_scale),
                "k_zero_read": f(self.k_zero), "k_levels_read": np.ascontiguousarray(k_levels[c0:c1]),
                "v_levels_read": np.ascontiguousarray(v_levels[c0:c1])}

    _REGION_ORDER = (*ARRAYS, "sink_k", "sink_v")  # what the numba page kernels take, in this order

    def _kept(self, pages: torch.Tensor, what: str, make):
        """`make()`, derived from this buffer, kept while the layout is handed the same buffer (the one an engine
        hands at every step): while anything derived from it is kept, the memory it views stays allocated, so a
        buffer at the same address, of the same size and strides, is that memory."""
        key = (pages.data_ptr(), pages.shape[0], pages.stride(0), pages.device)
        kept = self.__dict__.get("_buffer")
        if kept is None or kept[0] != key:
            kept = self._buffer = (key, {})
        hit = kept[1].get(what)
        if hit is None:
            hit = kept[1][what] = make()
        return hit

    def _regions_np(self, pages: torch.Tensor) -> list[np.ndarray]:
        """numpy views of every region of the buffer, in `_REGION_ORDER` (`_kept` for the buffer)."""
        return self._kept(pages, "numpy", lambda: [_numpy(self.region(pages, name)) for name in self._REGION_ORDER])

    def region(self, pages: torch.Tensor, name: str) -> torch.Tensor:
        """One region of every page, as [num_blocks, *shape] of its dtype (a view of `pages`, no copy)."""
        r = self.regions[name]
        n = pages.shape[0]
        raw = pages.view(n, self.page_bytes)[:, r.offset:r.offset + r.nbytes]
        return raw.view(r.dtype).view(n, *r.shape)

    def allocate(self, num_blocks: int, device: torch.device | str = "cpu", block_stride: int | None = None
                 ) -> torch.Tensor:
        """A zeroed buffer of `num_blocks` pages, uint8 [num_blocks, page_bytes] (what an engine allocates); with
        `block_stride`, each page starts that many bytes after the one before (an engine whose blocks hold other
        layers' pages too: a block-outermost KV layout), the bytes between them not this layout's."""
        if block_stride is None:
            return torch.zeros(num_blocks, self.page_bytes, dtype=torch.uint8, device=device)
        if block_stride < self.page_bytes or block_stride % ALIGN:
            raise ValueError(f"block_stride must be a multiple of {ALIGN} bytes of at least the page's "
                             f"{self.page_bytes}, got {block_stride}")
        whole = torch.zeros(max(0, num_blocks - 1) * block_stride + self.page_bytes, dtype=torch.uint8, device=device)
        return whole.as_strided((num_blocks, self.page_bytes), (block_stride, 1))

    def _check_pages(self, pages: torch.Tensor) -> None:
        """uint8 [num_blocks, page_bytes], each page contiguous and on 16 bytes, pages evenly apart (contiguous, or
        a block stride apart)."""
        ok = pages.dtype in (torch.uint8, torch.int8) and pages.dim() == 2 and pages.shape[1] == self.page_bytes
        if ok and pages.numel():
            ok = (pages.stride(1) == 1 and pages.stride(0) >= self.page_bytes and pages.stride(0) % ALIGN == 0
                  and pages.storage_offset() % ALIGN == 0)
        if not ok:
            raise ValueError(f"pages must be a uint8 [num_blocks, {self.page_bytes}] buffer, each page contiguous "
                             f"and the pages {ALIGN}-byte aligned and evenly apart, got {pages.dtype} "
                             f"{tuple(pages.shape)} with strides {tuple(pages.stride())}")

    def _flat(self, pages: torch.Tensor) -> torch.Tensor:
        """The buffer as one run of bytes from its first page's start to its last page's end (pages a block stride
        apart: the bytes between them included, never addressed)."""
        n, stride = pages.shape[0], pages.stride(0)
        return pages.as_strided(((n - 1) * stride + self.page_bytes,), (1,))

    # ---- writing -------------------------------------------------------------------------
    def write(self, pages: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              positions: torch.Tensor) -> int:
        """Quantize N tokens into their slots.

        Args:
            pages: the layer's buffer (`allocate`).
            slots: int [N], block * block_size + offset of each token; negative: skip the token (padding).
            keys: pre-RoPE keys [N, C]; values [N, C]; any float dtype. C is `full_channels`: a share is given
                every head's keys and values and keeps its own (see the module docstring).
            positions: int [N], each token's position in its sequence (positions below `sinks` are sinks).
        Returns:
            the number of key outliers clipped because a token had more than `key_slots` of them.
        """
        self._check_pages(pages)
        fast = self._fast(pages)
        if fast is not None:  # the same checks and work on numpy arrays: a step writes a few tokens a layer
            return self._write_numba(fast, pages, slots, keys, values, positions)
        keep = slots >= 0
        if not bool(keep.all()):
            slots, keys, values, positions = slots[keep], keys[keep], values[keep], positions[keep]
        n, c = keys.shape
        if n == 0:
            return 0
        self._check_write(keys.shape, values.shape)
        slots = slots.long()
        block, offset = slots // self.block_size, slots % self.block_size
        if int(block.max()) >= pages.shape[0] or int(slots.min()) < 0:
            raise ValueError(f"write: slot {int(slots.max())} is past the {pages.shape[0]} pages of the buffer")
        xk, xv = keys.float(), values.float()
        for name, x in (("keys", xk), ("values", xv)):
            if not bool((x.abs() <= FP16_MAX).all()):  # NaN fails it too
                self._refuse_range(name, float(x.nan_to_num(float('inf')).abs().max()))
        sink = (positions.long() < self.sinks).view(-1, 1)  # [N, 1]
        kq, vq = self.k_quant, self.v_quant
        c0, c1 = self.first_channel, self.first_channel + self.channels
        enc_k = kq.encode(xk)  # with `slots`, the mask holds exactly `key_slots` elements per token
        overflow = 0
        k_codes = enc_k.codes
        if self.key_slots:
            chosen = enc_k.outliers.nonzero(as_tuple=True)[1].view(n, self.key_slots)  # ascending per token
            k_codes = k_codes.masked_fill(enc_k.outliers, OUTLIER_CODE)
            past = (xk < kq.lo) | (xk > kq.hi)
            overflow = int((past & ~enc_k.outliers).sum())
            self._put_slots(pages, "k", block, offset, chosen, xk.gather(1, chosen))
        enc_v = vq.encode(xv)
        v_codes = enc_v.codes
        if self.value_slots:
            mask = enc_v.outliers
            chosen = mask.nonzero(as_tuple=True)[1].view(n, self.value_slots)  # row-major: ascending per token
            v_codes = v_codes.masked_fill(mask, OUTLIER_CODE)
            self._put_slots(pages, "v", block, offset, chosen, xv.gather(1, chosen))
        k_codes = k_codes[:, c0:c1].masked_fill(sink, OUTLIER_CODE)
        v_codes = v_codes[:, c0:c1].masked_fill(sink, OUTLIER_CODE)
        self._put(pages, "k_codes", block, offset, self._pack(k_codes, self.k_offsets, self.k_bits, "k_codes"))
        self._put(pages, "v_codes", block, offset, self._pack(v_codes, self.v_offsets, self.v_bits, "v_codes"))
        sz = torch.cat([enc_v.scale.expand(n, 1), enc_v.zero.expand(n, 1)], dim=1).masked_fill(sink, 0)
        self._put(pages, "v_scale_zero", block, offset, sz.half())
        rows = sink.view(-1).nonzero().flatten()
        if rows.numel():
            rank = positions[rows].long()
            self.region(pages, "sink_k")[block[rows], rank] = xk[rows, c0:c1].half()
            self.region(pages, "sink_v")[block[rows], rank] = xv[rows, c0:c1].half()
        return overflow

    def _put_slots(self, pages: torch.Tensor, side: str, block: torch.Tensor, offset: torch.Tensor,
                   chosen: torch.Tensor, exact: torch.Tensor) -> None:
        """A token's exact elements (channels `chosen` [N, k] of the whole token, ascending, and their values) as
        the share holds them: its own channels renumbered from its first, the others `NO_CHANNEL` with value 0,
        after its own (so a slot's channels stay in ascending order)."""
        own = (chosen >= self.first_channel) & (chosen < self.first_channel + self.channels)
        channel = torch.where(own, chosen - self.first_channel, NO_CHANNEL)
        order = channel.argsort(dim=1, stable=True)  # NO_CHANNEL sorts last
        channel, exact = channel.gather(1, order), torch.where(own, exact, 0.0).gather(1, order)
        self._put(pages, f"{side}_channels", block, offset, channel.to(torch.int32).to(torch.int16))
        self._put(pages, f"{side}_values", block, offset, exact.half())

    def _check_write(self, keys: tuple, values: tuple) -> None:
        if len(keys) != 2 or keys[1] != self.full_channels or tuple(values) != tuple(keys):
            raise ValueError(f"write: keys and values must be [N, {self.full_channels}] (every KV head's), got "
                             f"{tuple(keys)} and {tuple(values)}")

    @staticmethod
    def _refuse_range(name: str, largest: float) -> None:
        raise ValueError(f"write: {name} reach {largest:.4g} (or NaN), beyond float16's 65,504 that pages store "
                         "scales, outliers and sinks in; serve this model with vLLM's own KV cache")

    def _write_numba(self, fast, pages, slots, keys, values, positions) -> int:
        """`write` through the numba kernel: its checks on numpy arrays, then one compiled call."""
        s = slots.numpy().astype(np.int64, copy=False)
        xk = keys.detach().to(torch.float32).numpy()
        xv = values.detach().to(torch.float32).numpy()
        pos = positions.numpy().astype(np.int64, copy=False)
        keep = s >= 0
        if not keep.all():
            s, xk, xv, pos = s[keep], xk[keep], xv[keep], pos[keep]
        n = xk.shape[0]
        if n == 0:
            return 0
        self._check_write(xk.shape, xv.shape)
        block, offset = s // self.block_size, s % self.block_size
        if block.max() >= pages.shape[0]:
            raise ValueError(f"write: slot {int(s.max())} is past the {pages.shape[0]} pages of the buffer")
        for name, x in (("keys", xk), ("values", xv)):
            if not (np.abs(x) <= FP16_MAX).all():  # NaN fails it too
                self._refuse_range(name, float(np.abs(np.nan_to_num(x, nan=np.inf)).max()))
        tab = self._tables
        clipped = np.zeros(n, np.int64)
        side = self.v_quant.outliers_per_side(self.full_channels) if self.value_slots else 0
        c = np.ascontiguousarray
        fast.write_tokens(c(xk), c(xv), c(block), c(offset), c(pos), self.sinks, self.first_channel, self.channels,
                          tab["k_mids"], tab["k_levels"], tab["k_scale"], tab["k_zero"], tab["k_lo"], tab["k_hi"],
                          tab["k_offs"], self.key_slots, tab["v_mids"], tab["v_levels"], tab["v_offs"], side,
                          *self._regions_np(pages), clipped)
        return int(clipped.sum())

    def _pack(self, codes: torch.Tensor, offsets: torch.Tensor | None, bits: int, region: str) -> torch.Tensor:
        if offsets is None:
            return pack_codes(codes, bits)
        return pack_mixed(codes, offsets, words=self.regions[region].shape[1])

    def _put(self, pages: torch.Tensor, name: str, block: torch.Tensor, offset: torch.Tensor, rows: torch.Tensor):
        self.region(pages, name)[block, offset] = rows.to(self.regions[name].dtype)

    # ---- reading -------------------------------------------------------------------------
    def view(self, pages: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
             in_place: bool = False, memo: dict | None = None) -> tuple[StoreView, torch.Tensor]:
        """The cache of B sequences as one `StoreView` (T = the longest sequence) and its key mask bool [B, T].

        Args:
            block_table: int [B, >= pages needed], the pages of each sequence in order.
            seq_lens: int [B], tokens cached per sequence (the new ones included).
            in_place: with a power-of-two block size, a view of the pages themselves (`StoreView.rows`: each
                token's slot in its page, no copy), which the numba and Triton kernels read through the block
                tables and the reference gathers (`StoreView.gathered`); a masked slot past a sequence's end names the
                sequence's first slot (written, so finite). Other block sizes: the gathered copy.
            memo: a dict the caller keeps while `block_table` and `seq_lens` stay the same tensors (an engine's
                step, over every layer): the in-place view's slots, mask, sinks and positions, which depend on
                those and the block size alone, are built once and read from it by every layout of that block size.
        Token t of sequence b sits at position t. A shorter sequence's slots past its length are zeroed in the
        gathered copy (whatever a page held there before) and masked.
        """
        self._check_pages(pages)
        bs = self.block_size
        key = ("view", bs, self.sinks, pages.device)
        hit = memo.get(key) if memo is not None and in_place and bs & (bs - 1) == 0 else None
        if hit is not None and hit[0] is block_table and hit[1] is seq_lens:
            return self._paged_view(pages, *hit[2:]), hit[3]
        lens = seq_lens.to(torch.long).cpu()
        b = lens.numel()
        t = int(lens.max()) if b else 0
        nb = -(-t // self.block_size)
        if b == 0 or t == 0 or int(lens.min()) < 1:
            raise ValueError(f"view: sequences of {lens.tolist()} tokens; write the new tokens before attending")
        if block_table.dim() != 2 or block_table.shape[0] != b or block_table.shape[1] < nb:
            raise ValueError(f"view: {b} sequences of up to {t} tokens need a block table [{b}, >= {nb}], got "
                             f"{tuple(block_table.shape)}")
        table = block_table[:, :nb].to(device=pages.device, dtype=torch.long)
        dev = pages.device
        used = torch.arange(nb, device=dev).view(1, -1) < (lens.to(dev).view(-1, 1) + bs - 1) // bs  # [B, nb]
        if bool((used & ((table < 0) | (table >= pages.shape[0]))).any()):  # the compiled readers do not check
            bad = [(i, table[i, used[i]].tolist()) for i in range(b)
                   if bool(((table[i, used[i]] < 0) | (table[i, used[i]] >= pages.shape[0])).any())]
            raise ValueError(f"view: the block table names pages outside the buffer's {pages.shape[0]}: sequence "
                             f"{bad[0][0]} of {int(lens[bad[0][0]])} tokens reads pages {bad[0][1]}")
        live = torch.arange(nb * bs).view(1, -1) < lens.view(-1, 1)  # [B, nb*bs]
        mask = live[:, :t].to(dev)
        if in_place and bs & (bs - 1) == 0:
            rows = self._paged_rows(table, lens, t, mask)
            if memo is not None:
                memo[key] = (block_table, seq_lens, rows, mask)
            return self._paged_view(pages, rows, mask), mask

        fast = self._fast(pages)
        if fast is not None:
            table_np = np.ascontiguousarray(table.to(torch.int64).numpy())
            lens_np = np.ascontiguousarray(lens.numpy())
            regions_np = dict(zip(self._REGION_ORDER, self._regions_np(pages)))

        def grid(name: str) -> torch.Tensor:  # [T, B, ...] token-major, dead slots zeroed
            r = self.regions[name]
            if fast is not None:
                out = torch.empty(t, b, r.shape[1], dtype=r.dtype)
                fast.gather_rows(regions_np[name], table_np, lens_np, bs, _numpy(out))
                return out
            x = self.region(pages, name)[table]  # [B, nb, bs, w]
            x = x.reshape(b, nb * bs, r.shape[1])[:, :t]
            x = x.masked_fill(~mask.unsqueeze(-1), 0)
            return x.transpose(0, 1).contiguous()

        k_codes, v_codes, sz = grid("k_codes"), grid("v_codes"), grid("v_scale_zero")
        slots = t * b
        k_out = v_out = None
        if self.key_slots:
            kk = self.key_slots
            pointers = torch.arange(slots + 1, dtype=torch.int32, device=dev) * kk
            k_out = Outliers(pointers, grid("k_channels").reshape(-1), grid("k_values").reshape(-1), slots * kk,
                             kk, OUTLIER_CODE)
        if self.value_slots:
            vk = self.value_slots
            v_out = Outliers(None, grid("v_channels").reshape(-1), grid("v_values").reshape(-1), slots * vk, vk,
                             OUTLIER_CODE)
        first = table[:, 0]
        s = self.sinks
        sink_k = self.region(pages, "sink_k")[first]  # [B, S, C]
        sink_v = self.region(pages, "sink_v")[first]
        rank = torch.arange(s).view(1, -1)
        sink_slot = torch.where(rank < lens.view(-1, 1), rank, -1).to(torch.int32).to(dev)
        positions = torch.arange(t, dtype=torch.int32, device=dev).view(-1, 1).expand(t, b).contiguous()
        view = StoreView(self.heads, self.head_dim, self.k_bits, self.v_bits, t, k_codes, v_codes,
                         self.k_scale.to(dev), self.k_zero.to(dev), *self._levels(dev), sz, k_out, v_out, sink_k,
                         sink_v, sink_slot, positions, {}, *self._offsets(dev))
        return view, mask

    def _paged_rows(self, table: torch.Tensor, lens: torch.Tensor, t: int, mask: torch.Tensor) -> tuple:
        """What an in-place view of these sequences needs besides the pages: (slots int32 [B, T], T, the first
        page of each sequence, sink_slot int32 [B, S], positions int32 [T, B]); the same for every layout of
        this block size and sink count."""
        bs, b, dev = self.block_size, lens.numel(), mask.device
        tok = torch.arange(t, device=dev)
        slots = table[:, tok // bs] * bs + tok % bs  # [B, T]
        slots = torch.where(mask, slots, table[:, :1] * bs).to(torch.int32).contiguous()
        rank = torch.arange(self.sinks).view(1, -1)
        sink_slot = torch.where(rank < lens.view(-1, 1), rank, -1).to(torch.int32).to(dev)
        positions = torch.arange(t, dtype=torch.int32, device=dev).view(-1, 1).expand(t, b).contiguous()
        return slots, t, table[:, 0], sink_slot, positions

    def _paged_view(self, pages: torch.Tensor, rows: tuple, mask: torch.Tensor) -> StoreView:
        """`view(..., in_place=True)`: flat views of the whole buffer and where each slot's data lies in them
        (`rows`: of `_paged_rows`)."""
        slots, t, first, sink_slot, positions = rows
        words, halves, k_out, v_out, geometry = self._flat_views(pages)
        where = Rows(slots, self.block_size.bit_length() - 1, *geometry)
        dev = pages.device
        return StoreView(self.heads, self.head_dim, self.k_bits, self.v_bits, t, words, words, self.k_scale.to(dev),
                         self.k_zero.to(dev), *self._levels(dev), halves, k_out, v_out,
                         self.region(pages, "sink_k")[first], self.region(pages, "sink_v")[first], sink_slot,
                         positions, self._memo, *self._offsets(dev), rows=where)

    def _flat_views(self, pages: torch.Tensor) -> tuple:
        """(the buffer as int32 words, as 16-bit halves, the key and value outliers over them, (page, width,
        offset) of every array of `ARRAYS` in elements of its dtype): `_kept` for the buffer, so that the kernels'
        conversions of these tensors are kept too (`StoreView.memo`)."""
        return self._kept(pages, "flat", lambda: self._make_flat_views(pages))

    def _make_flat_views(self, pages: torch.Tensor) -> tuple:
        flat = self._flat(pages)
        words, halves = flat.view(torch.int32), flat.view(torch.float16)
        page, width, offset = [], [], []
        for name in ARRAYS:  # in elements of the array's dtype: int32 codes, 16-bit everything else
            r = self.regions[name]
            size = r.dtype.itemsize
            page.append(pages.stride(0) // size)  # from one page to the next: the page, or the block stride
            width.append(r.shape[1])
            offset.append(r.offset // size)
        n_slots = pages.shape[0] * self.block_size
        k_out = v_out = None
        if self.key_slots:
            k_out = Outliers(None, flat.view(torch.int16), halves, n_slots * self.key_slots, self.key_slots,
                             OUTLIER_CODE)
        if self.value_slots:
            v_out = Outliers(None, flat.view(torch.int16), halves, n_slots * self.value_slots, self.value_slots,
                             OUTLIER_CODE)
        return words, halves, k_out, v_out, (tuple(page), tuple(width), tuple(offset))

    def with_window(self, view: StoreView, keys: torch.Tensor, values: torch.Tensor, lens: torch.Tensor,
                    memo: dict | None = None, joined: bool = False) -> StoreView:
        """`view` (of `view()`) whose rows also read their most recent tokens exact: an fp16 window (`:rN`), held
        wherever the engine keeps it, given as the pre-RoPE keys and values [B, W, C] of each row's positions
        lens - W .. lens - 1. The kernels read them as they read sinks (exact entries naming their token); a
        position below the sinks or below 0 gets no entry, so no token is named twice. `joined`: keys and values
        are fp16 [B, S + W, C] that hold each row's S sinks first, as `view.sink_k` / `sink_v` do, then its window
        (`sink_regions` and `kernels.numba.pages.sinks_and_window` gather both in one pass)."""
        b, w = keys.shape[0], keys.shape[1] - (self.sinks if joined else 0)
        if keys.shape != values.shape or keys.shape[2] != self.channels or b != view.sink_k.shape[0] or w < 0 \
                or (joined and keys.dtype != torch.float16):
            what = "fp16 [B, S + W, C] with the sinks first" if joined else "[B, W, C]"
            raise ValueError(f"with_window: keys and values {what} expected for B = {view.sink_k.shape[0]}, S = "
                             f"{self.sinks}, C = {self.channels}, got {keys.dtype} {tuple(keys.shape)} and "
                             f"{tuple(values.shape)}")
        dev = view.sink_k.device
        key = ("window", w, self.sinks, dev)
        hit = memo.get(key) if memo is not None else None
        if hit is not None and hit[0] is lens and hit[1] is view.sink_slot:
            sink_slot = hit[2]
        else:
            pos = lens.to(dev, torch.long).view(-1, 1) - w + torch.arange(w, device=dev).view(1, -1)
            slot = torch.where(pos >= self.sinks, pos, -1).to(torch.int32)
            sink_slot = torch.cat([view.sink_slot, slot], dim=1)
            if memo is not None:  # (the sink slots of a memoized view are the same tensor at every layer)
                memo[key] = (lens, view.sink_slot, sink_slot)
        if joined:
            return view._replace(sink_k=keys.to(dev), sink_v=values.to(dev), sink_slot=sink_slot)
        return view._replace(sink_k=torch.cat([view.sink_k, keys.to(dev, torch.float16)], dim=1),
                             sink_v=torch.cat([view.sink_v, values.to(dev, torch.float16)], dim=1),
                             sink_slot=sink_slot)

    def sink_regions(self, pages: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """The sink keys and values of every page of a CPU buffer as numpy int16 views [blocks, S, C] (fp16 bits,
        strided as the pages are): what a compiled reader takes a row's sinks from."""
        regions = dict(zip(self._REGION_ORDER, self._regions_np(pages)))
        return regions["sink_k"].view(np.int16), regions["sink_v"].view(np.int16)

    def _levels(self, dev) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value levels a view decodes with: the codebook, or [C, 2**bits] with channel widths."""
        k, v = self._decode_levels
        return k.to(dev), v.to(dev)

    @functools.cached_property
    def _decode_levels(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The quantizers' decode levels (of the share's channels), built once: with channel widths they are a
        table stacked per call, and a new tensor every step would also make the kernels rebuild their lookup tables
        (kept in `_memo` while the tensors they came from are the same)."""
        return self._k_share.decode_levels, self._v_share.decode_levels

    def _offsets(self, dev) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return tuple(None if o is None else o.to(dev) for o in (self.k_offsets, self.v_offsets))

    @functools.cached_property
    def _memo(self) -> dict:
        """The memo of this layout's in-place views: what a backend derives from the layout's own tensors (its
        lookup tables) is kept between steps; what it derives from a step's arrays it checks and rebuilds."""
        return {}

    def read(self, pages: torch.Tensor, table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's first `length` tokens, dequantized: pre-RoPE keys and values, float32 [T, C] each,
        as `kernels.reference.dequantize_view` reconstructs them from `view` (the outliers and sinks exact).

        Args:
            table: int [>= pages needed], the sequence's pages in order.
        """
        self._check_pages(pages)
        if length < 1:
            raise ValueError(f"read: a sequence of {length} tokens; write its tokens before reading them")
        fast = self._fast(pages)
        if fast is None:
            from ..kernels.reference import dequantize_view

            view, _ = self.view(pages, table.view(1, -1), torch.tensor([length]))
            k, v = dequantize_view(view)
            return k[:, 0], v[:, 0]
        nb = -(-length // self.block_size)
        if table.numel() < nb or int(table[:nb].max()) >= pages.shape[0] or int(table[:nb].min()) < 0:
            raise ValueError(f"read: {length} tokens need {nb} pages of the buffer's {pages.shape[0]}, the table "
                             f"names {table[:nb].tolist()}")
        tab = self._tables
        keys = torch.empty(length, self.channels, dtype=torch.float32)  # not the default dtype (an engine sets it)
        values = torch.empty(length, self.channels, dtype=torch.float32)
        fast.read_sequence(np.ascontiguousarray(table[:nb].to(torch.int64).numpy()), length, self.block_size,
                           self.sinks, tab["k_offs"], tab["v_offs"], tab["k_levels_read"], tab["k_scale_read"],
                           tab["k_zero_read"], tab["v_levels_read"], *self._regions_np(pages), keys.numpy(),
                           values.numpy())
        return keys, values
