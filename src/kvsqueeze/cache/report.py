"""What a compressed cache really occupies: exact bytes by component, against an fp16 DynamicCache.

Components (bytes in use, summed over layers; growth slack is reported apart
as `capacity_bytes`), the same names and the same bytes as `storage.layer_bytes`
(`methods.cache_bytes` for a whole model), which `tests/test_storage.py` holds
equal byte for byte:

* codes: packed K and V codes of the quantized tokens (whole int32 words, the
  padding of each slot's last word included).
* scales: fp16 (scale, zero-point) of every key channel and every value token.
* outlier_values: fp16 values of the sparse K and V outliers.
* outlier_indices: their 16-bit channel indices.
* pointers: CSC (keys) and CSR (values) pointers, one per quantized token plus
  one (none for values that keep the same top-k count every token).
* sinks: fp16 keys and values of the attention-sink tokens.
* fp16_window: fp16 copies of each row's most recent tokens (`:rN` methods),
  held beside their codes.
* codebook: the levels decoding reads (float32, bit-exact with the recipe) and
  the per-channel key thresholds encoding reads (float32 lo/hi).
* decode_tables: the per-channel tables the kernels read for per-channel widths
  (`[C, 2^maxw]` float32 and int32 offsets per layer and tensor).
* sink_slots: what sink tokens leave in the rectangular grids (zero codes,
  zero value scales, repeated pointers) plus each sink's slot index.
* positions: the RoPE position of each token (int32 per token and row, once
  for all full layers, and once more in each sliding-window layer for the
  tokens it keeps).

Sliding-window layers keep only the most recent tokens (`held_token_layers`
counts the tokens held, summed over layers), and so does the fp16
`DynamicCache` the report compares against (`dynamic_token_layers`: the last
window - 1 tokens on those layers, every token on the others).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..storage import COMPONENTS, FP16_BYTES


@dataclass(frozen=True)
class MemoryReport:
    """Bytes held by one cache; see the module docstring."""

    method: str
    layers: int
    batch: int
    tokens: int  # sequence length (per row, padding included)
    channels: int  # K (= V) channels per token and layer
    components: dict[str, int] = field(default_factory=dict)
    capacity_bytes: int = 0  # allocated, growth slack included
    held_token_layers: int | None = None  # tokens held per row, summed over layers (None: layers * tokens)
    dynamic_token_layers: int | None = None  # what an fp16 DynamicCache holds, the same way (None: layers * tokens)

    @property
    def total_bytes(self) -> int:
        return sum(self.components.values())

    @property
    def token_rows(self) -> int:
        return self.batch * self.tokens

    def _layer_rows(self, count: int | None) -> int:
        return self.batch * (self.layers * self.tokens if count is None else count)

    @property
    def bytes_per_token(self) -> float:
        """Total bytes per cached token (of one row), all layers."""
        return self.total_bytes / self.token_rows if self.token_rows else float("nan")

    @property
    def fp16_bytes(self) -> int:
        """What transformers' DynamicCache holds for the same tokens in fp16: K and V of every layer, the last
        window - 1 tokens of a sliding-window layer."""
        return 2 * self._layer_rows(self.dynamic_token_layers) * self.channels * FP16_BYTES

    @property
    def compression(self) -> float:
        """fp16 bytes / bytes held (inf for an empty cache)."""
        return self.fp16_bytes / self.total_bytes if self.total_bytes else float("inf")

    @property
    def avg_bits(self) -> float:
        """Bits held per K/V element held (NaN for an empty cache: there is no element to divide by)."""
        elements = 2 * self._layer_rows(self.held_token_layers) * self.channels
        return 8 * self.total_bytes / elements if elements else float("nan")

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update(total_bytes=self.total_bytes, bytes_per_token=self.bytes_per_token, fp16_bytes=self.fp16_bytes,
                   compression_vs_fp16=self.compression, avg_bits=self.avg_bits)
        return out

    def format(self) -> str:
        """A small table for the terminal."""
        lines = [f"KV cache {self.method}: {self.layers} layers, batch {self.batch} x {self.tokens} tokens, "
                 f"{self.channels} channels"]
        width = max(len(k) for k in COMPONENTS)
        total = max(self.total_bytes, 1)
        for name in COMPONENTS:
            n = self.components.get(name, 0)
            if n:
                lines.append(f"  {name:<{width}}  {n:>12,} B  {100 * n / total:5.1f}%")
        if not self.token_rows:
            lines.append(f"  {'total':<{width}}  {self.total_bytes:>12,} B  (no tokens cached yet; allocated "
                         f"{self.capacity_bytes:,} B)")
            return "\n".join(lines)
        lines.append(f"  {'total':<{width}}  {self.total_bytes:>12,} B  ({self.bytes_per_token:,.1f} B/token, "
                     f"{self.avg_bits:.2f} bits/element; allocated {self.capacity_bytes:,} B)")
        lines.append(f"  {'fp16 cache':<{width}}  {self.fp16_bytes:>12,} B  ({self.compression:.2f}x smaller)")
        return "\n".join(lines)
