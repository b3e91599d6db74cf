"""KV-cache memory planner: how many bytes a method's cache takes, and whether it fits.

Paper-capacity arithmetic in the style of KVQuant's appendix A (Hooper et al.,
arXiv 2401.18079): for a model shape, a list of methods and a list of context
lengths, the cache size in bytes, the average stored bits per element, the
weight bytes at 16 and 4 bits, and whether weights plus cache fit on G GPUs of
M bytes each. It is a *paper* estimate: activations, temporary buffers and
allocator fragmentation are not counted.

The accounting is the method registry's `cache_bytes`: for the methods the
compressed cache holds, exactly the bytes its memory report gives (codes in
whole words, scales and zero-points, outlier values, indices and pointers,
sinks, fp16 windows, codebooks and decode tables, slot tables, positions);
a bit budget reads its choice from a recipe of the model.

Units are binary throughout, as in the paper's table: a context of `128K` is
131,072 tokens, `1M` is 1,048,576, and sizes are reported in GiB. (One
caveat: the paper's own 10M column is decimal, 10,000,000 tokens — its fp16
figure for LLaMA-7B, 4883 GB, is 10**7 x 512 KiB. Pass `10000000` to
reproduce that column; `10M` here is 10 x 2**20 tokens, about 5% more.)
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path

from ..config import MemoryConfig
from ..methods import MethodError, MethodSpec, cache_bytes, parse_method, parse_methods
from ..storage import Rows, held_by_layer, tokens_held
from ..shape import KVShape, kv_shape, positive_int
from .tables import text_table

GIB = 1024**3
FP16 = parse_method("fp16")


@dataclass(frozen=True)
class ModelShape(KVShape):
    """A model's KV-cache shape (`kvsqueeze.shape.KVShape`) with its name and parameter count."""

    name: str = ""
    params: float = 0.0  # total parameter count, for weight bytes only
    windows: tuple[int | None, ...] | None = None  # each layer's sliding window (None: every layer full)

    def held(self, tokens: int) -> list[int | None] | None:
        """Tokens each layer holds of a row of `tokens` (`storage.held_by_layer`: None for all of them); None for
        a shape without layer windows (every layer full)."""
        return None if self.windows is None else held_by_layer(self.windows, tokens)

    def held_tokens(self, tokens: int) -> int:
        """Tokens held of a row, summed over layers (what bits per element divide by)."""
        return tokens_held(self.held(tokens), tokens, self.layers)


# Parameter counts as published (LLaMA: 6.74B / 13.0B / 65.2B, the figures
# behind the paper's 12.6 / 24.1 / 121.1 GB of fp16 weights).
BUILTIN_SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape(name="llama-7b", layers=32, heads=32, kv_heads=32, head_dim=128, params=6.74e9),
        ModelShape(name="llama-13b", layers=40, heads=40, kv_heads=40, head_dim=128, params=13.0e9),
        ModelShape(name="llama-65b", layers=80, heads=64, kv_heads=64, head_dim=128, params=65.2e9),
        ModelShape(name="llama-3-8b", layers=32, heads=32, kv_heads=8, head_dim=128, params=8.03e9),
        ModelShape(name="smollm2-135m", layers=30, heads=9, kv_heads=3, head_dim=64, params=134.5e6),
    )
}


# ---------------------------------------------------------------- model shapes


def resolve_model(model: str) -> ModelShape:
    """A built-in shape by name (case-insensitive), or one read from a config.json.

    Args:
        model: a built-in name (see `BUILTIN_SHAPES`), a path to a Hugging Face
            `config.json`, or a directory that holds one.

    Raises:
        ValueError: unknown name, missing file, or a config without usable sizes.
    """
    text = model.strip()
    key = text.lower()
    if key in BUILTIN_SHAPES:
        return BUILTIN_SHAPES[key]
    path = Path(text).expanduser()
    if path.exists():
        return shape_from_config(path)
    raise ValueError(
        f"unknown model {model!r}: built-in shapes are {', '.join(BUILTIN_SHAPES)}; "
        "or pass the path of a Hugging Face config.json (or a directory containing one) "
        "— the planner reads local files only and downloads nothing"
    )


def shape_from_config(path: str | Path) -> ModelShape:
    """Read a `ModelShape` from a Hugging Face `config.json` (or its directory).

    layers = num_hidden_layers; kv_heads = num_key_value_heads (default
    num_attention_heads, i.e. plain multi-head attention); head_dim = head_dim
    if given, else hidden_size // num_attention_heads. Multimodal configs whose
    language model sits under `text_config` are read from there. The
    parameter count is estimated by `estimate_params`.

    Raises:
        ValueError: the file is missing or not JSON, or a size is missing,
            zero, negative or inconsistent.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ValueError(f"no config.json at {str(p)!r}: pass a built-in model name or a Hugging Face config.json path")
    try:
        cfg = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read model config {str(p)!r} as JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"model config {str(p)!r} is not a JSON object")
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]
    where = f"model config {str(p)!r}"
    shape = kv_shape(cfg, where)
    name = str(cfg.get("_name_or_path") or "").strip() or p.resolve().parent.name or p.stem
    return ModelShape(**asdict(shape), name=name, params=float(estimate_params(cfg, where)),
                      windows=_layer_windows(cfg, shape.layers, where))


def _slides(cfg: dict) -> bool:
    """Whether a config asks for sliding-window layers in any of the ways transformers reads."""
    kinds = cfg.get("layer_types") or ()
    return (any("sliding" in str(k) or "chunk" in str(k) for k in kinds) or bool(cfg.get("attention_chunk_size"))
            or (cfg.get("sliding_window") is not None and cfg.get("use_sliding_window", True) is not False))


def _layer_windows(cfg: dict, layers: int, where: str) -> tuple[int | None, ...] | None:
    """Each layer's sliding window as transformers' `DynamicCache` keeps it for the config read (`cfg`, the
    language model's; `parts.config_windows`, the rule the caches follow); None for every layer full. A config
    that asks for sliding layers in a way this cannot read (a model type transformers does not know, chunked
    attention) is refused: planned as full layers, its memory would be overstated and a bit budget's choices
    made for tokens its layers do not hold."""
    from transformers import AutoConfig

    from ..integrations.parts import config_windows

    try:
        windows = config_windows(AutoConfig.for_model(**cfg), where)
        if len(windows) != layers:
            raise ValueError(f"transformers builds {len(windows)} cache layers for its {layers} layers")
    except Exception as exc:  # noqa: BLE001 - an unknown model type, or layers the caches cannot hold
        if _slides(cfg):
            raise ValueError(f"{where} asks for sliding-window layers, but the planner cannot count them "
                             f"({type(exc).__name__}: {exc}); plan a built-in shape or a config of a model type "
                             "transformers knows") from exc
        return None
    return tuple(windows) if any(w is not None for w in windows) else None


def estimate_params(cfg: dict, where: str = "model config") -> int:
    """Estimate a LLaMA-style decoder's parameter count from its config.

    Counted: token embeddings (vocab x hidden); per layer the attention
    projections q and o (hidden x heads*head_dim each) and k and v
    (hidden x kv_heads*head_dim each), the gated MLP gate/up/down
    (3 x hidden x intermediate_size) and two RMSNorm weights (2 x hidden); the
    final norm (hidden); and an untied lm_head (vocab x hidden) unless
    `tie_word_embeddings` is true. Not counted: biases (Qwen's q/k/v bias
    is well under 0.1%), mixture-of-experts layouts, vision towers. For
    LLaMA-7B this gives 6.74e9 and for SmolLM2-135M 134.5e6, the published counts.

    Raises:
        ValueError: vocab_size, hidden_size, intermediate_size or a head
            count is missing or not positive.
    """
    shape = kv_shape(cfg, where)
    layers, heads, kv_heads, head_dim = shape.layers, shape.heads, shape.kv_heads, shape.head_dim
    hidden = positive_int(cfg, "hidden_size", where)
    vocab = positive_int(cfg, "vocab_size", where)
    inter = positive_int(cfg, "intermediate_size", where)
    attn = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim  # q, o; k, v
    mlp = 3 * hidden * inter  # gate, up, down
    per_layer = attn + mlp + 2 * hidden  # + input and post-attention norms
    embed = vocab * hidden
    # An absent key is read as untied: LlamaConfig's default (the base
    # PretrainedConfig's is True, but LLaMA-family configs spell it out).
    lm_head = 0 if cfg.get("tie_word_embeddings", False) else vocab * hidden
    return embed + layers * per_layer + hidden + lm_head


# ---------------------------------------------------------------- sizes

_SIZE_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}
_SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)([KMG]?)$", re.IGNORECASE)
_SIZE_FORMS = "a positive whole number of tokens, e.g. 8192, 32K, 128k, 1M, 1.5M (K = 1024, M = 1024**2, G = 1024**3)"


def parse_size(text: str) -> int:
    """Parse a context length in tokens: `8192`, `32K`, `128k`, `1M`, `1.5M`.

    K, M and G are binary (1024, 1024**2, 1024**3), as the paper's context
    lengths are: 128K = 131,072 tokens.

    Raises:
        ValueError: empty, zero, negative, an unknown unit, or a value that is
            not a whole number of tokens (`1.5`, `1.3K`).
    """
    token = text.strip()
    m = _SIZE_RE.match(token)
    if not m:
        raise ValueError(f"bad context length {text!r}: expected {_SIZE_FORMS}")
    tokens = Fraction(m[1]) * _SIZE_UNITS[m[2].upper()]
    if tokens.denominator != 1:
        raise ValueError(
            f"bad context length {text!r}: {float(tokens):g} is not a whole number of tokens; "
            f"expected {_SIZE_FORMS}"
        )
    if tokens <= 0:
        raise ValueError(f"bad context length {text!r}: must be at least one token; expected {_SIZE_FORMS}")
    return int(tokens)


def parse_contexts(text: str) -> list[tuple[str, int]]:
    """Parse a comma-separated list of context lengths into (label as given, tokens)."""
    labels = [t.strip() for t in text.split(",") if t.strip()]
    if not labels:
        raise ValueError(f"no context lengths given: expected a comma-separated list of {_SIZE_FORMS}")
    return [(label, parse_size(label)) for label in labels]


_BYTES_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
_BYTES_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*(?:([KMGT])(?:I?B)?|B)?$", re.IGNORECASE)
_BYTES_FORMS = "a positive size such as 80GB, 80GiB, 48G, 512MiB, 1TB or a plain byte count"


def parse_bytes(text: str) -> int:
    """Parse a memory size such as `80GB`, `80GiB` or `48G` into bytes.

    Every unit is binary: GB is read as GiB (1024**3), the convention of the
    paper's table (and of "an 80 GB GPU", whose usable memory is ~80 GiB).
    KB/MB/TB likewise. A bare number is bytes; fractions are rounded down.

    Raises:
        ValueError: empty, zero, negative or an unknown unit.
    """
    token = text.strip()
    m = _BYTES_RE.match(token)
    if not m:
        raise ValueError(f"bad memory size {text!r}: expected {_BYTES_FORMS}")
    n = int(Fraction(m[1]) * _BYTES_UNITS[(m[2] or "").upper()])
    if n <= 0:
        raise ValueError(f"bad memory size {text!r}: must be positive; expected {_BYTES_FORMS}")
    return n


# ---------------------------------------------------------------- accounting


def _kv_bytes(shape: ModelShape, spec: MethodSpec, tokens: int, batch: int, recipe=None) -> float:
    """Bytes of the whole cache for `batch` rows of `tokens` tokens: the method's `cache_bytes` (per-layer
    codebooks, key ranges and tables counted once for the batch, as the cache holds them)."""
    rows = Rows(tokens, (0,) * batch)
    return float(sum(cache_bytes(spec, shape.layers, shape.channels, shape.head_dim, rows, recipe,
                                 shape.held(tokens)).values()))


def kv_cache_bytes(shape: ModelShape, spec: MethodSpec, tokens: int, batch: int = 1, recipe=None) -> int:
    """Bytes of K and V cache for `batch` sequences of `tokens` tokens (rounded up); a bit budget reads its
    choice from `recipe`."""
    if tokens < 1 or batch < 1:
        raise ValueError(f"tokens and batch must be positive, got tokens={tokens}, batch={batch}")
    return math.ceil(_kv_bytes(shape, spec, tokens, batch, recipe))


def weight_bytes(shape: ModelShape, bits: int = 16) -> int:
    """Weight bytes at `bits` per parameter: params * bits / 8, nothing else.

    No quantization scales, no embeddings kept at higher precision; at 4 bits
    the real figure is a few percent higher.
    """
    return math.ceil(shape.params * bits / 8)


def plan(
    shape: ModelShape,
    specs: list[MethodSpec],
    contexts: list[tuple[str, int]],
    batch: int = MemoryConfig.batch,
    gpus: int = MemoryConfig.gpus,
    gpu_mem_bytes: int | None = None,
    recipe=None,
) -> list[dict]:
    """One row per (method, context): cache and weight bytes and whether they fit.

    `fits` compares fp16 weights plus the cache with `gpus * gpu_mem_bytes`
    for every method, so that rows differ only in their cache;
    `fits_4bit_weights` is the same check with 4-bit weights (the paper's
    1M-context LLaMA-7B setting). `per_gpu_bytes` is the fp16-weight total
    split evenly over the GPUs.
    """
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    if gpus < 1:
        raise ValueError(f"gpus must be at least 1, got {gpus}")
    if gpu_mem_bytes is None:
        gpu_mem_bytes = parse_bytes(MemoryConfig.gpu_mem)
    capacity = gpus * gpu_mem_bytes
    w16, w4 = weight_bytes(shape, 16), weight_bytes(shape, 4)
    rows = []
    for spec in specs:
        for label, tokens in contexts:
            kv = kv_cache_bytes(shape, spec, tokens, batch, recipe)
            fp16 = kv_cache_bytes(shape, FP16, tokens, batch)
            elements = 2 * batch * shape.held_tokens(tokens) * shape.channels  # a sliding layer: its window
            total = w16 + kv
            rows.append(dict(
                method=spec.name,
                context=tokens,
                kv_bytes=kv,
                weight_bytes=w16,
                fits=total <= capacity,
                context_label=label,
                batch=batch,
                avg_bits=8 * _kv_bytes(shape, spec, tokens, batch, recipe) / elements,
                compression_vs_fp16=fp16 / kv,
                weight_bytes_4bit=w4,
                total_bytes=total,
                per_gpu_bytes=math.ceil(total / gpus),
                fits_4bit_weights=w4 + kv <= capacity,
                gpus=gpus,
                gpu_mem_bytes=gpu_mem_bytes,
            ))
    return rows


# ---------------------------------------------------------------- command


def format_table(shape: ModelShape, rows: list[dict], gpus: int, gpu_mem_label: str) -> str:
    """A plain-text table of `plan` rows (sizes in GiB)."""
    fits_head = f"fits {gpus}x{gpu_mem_label}"
    head = ("method", "context", "KV GiB", "avg bits", "vs fp16", "weights GiB 16b/4b", "per-GPU GiB",
            fits_head)
    body = []
    for r in rows:
        fits = "yes" if r["fits"] else ("4-bit weights only" if r["fits_4bit_weights"] else "no")
        body.append((
            r["method"],
            r["context_label"],
            f"{r['kv_bytes'] / GIB:,.2f}",
            f"{r['avg_bits']:.3f}",
            f"{r['compression_vs_fp16']:.2f}x",
            f"{r['weight_bytes'] / GIB:,.2f} / {r['weight_bytes_4bit'] / GIB:,.2f}",
            f"{r['per_gpu_bytes'] / GIB:,.2f}",
            fits,
        ))
    title = (f"{shape.name}: {shape.layers} layers x {shape.kv_heads} KV heads x head_dim {shape.head_dim}, "
             f"{shape.params / 1e9:.3g}B params, batch {rows[0]['batch'] if rows else 1}")
    return text_table(head, body, left={0, 1, 7}, title=title)


def run_memory_command(
    model: str,
    contexts: str,
    methods: str,
    batch: int = MemoryConfig.batch,
    gpus: int = MemoryConfig.gpus,
    gpu_mem: str = MemoryConfig.gpu_mem,
    json_out: str | None = None,
    recipe: str | None = None,
) -> dict:
    """`kvsqueeze memory`: print the plan as a table, optionally write it as JSON, return it.

    Args:
        model: built-in shape name or a Hugging Face config.json path / directory.
        contexts: comma-separated context lengths, e.g. `"32K,128K,1M,10M"`.
        methods: comma-separated method names, e.g. `"fp16,nuq3-1%,nuq2"`; a preset (`q3.5`) is chosen for each
            context (`preset_reaching`), so its rows name the budget it resolves to there.
        batch: sequences cached at once.
        gpus, gpu_mem: G GPUs of `gpu_mem` each (GB read as GiB).
        json_out: path to write `{"model": NAME, "rows": [...]}` to.
        recipe: a recipe directory of this model, which bit budgets (`nuq@B`) read their choice from.

    Returns:
        `{"model": NAME, "rows": [{"method", "context", "kv_bytes",
        "weight_bytes", "fits", ...}]}` with context in tokens.
    """
    shape = resolve_model(model)
    ctx = parse_contexts(contexts)
    # a preset (q3.5, ...) is chosen for the context it caches, as `generate`, `eval` and `ruler` choose it
    by_context = {tokens: parse_methods(methods, reaching=tokens, layer_windows=shape.windows or ())
                  for _, tokens in ctx}
    loaded = _budget_recipe(shape, [s for specs in by_context.values() for s in specs], recipe)
    mem = parse_bytes(gpu_mem)
    rows = []
    for i in range(len(by_context[ctx[0][1]])):  # method by method, each at every context
        for label, tokens in ctx:
            rows += plan(shape, [by_context[tokens][i]], [(label, tokens)], batch=batch, gpus=gpus, gpu_mem_bytes=mem,
                         recipe=loaded)
    print(format_table(shape, rows, gpus, gpu_mem.strip()))
    result = {"model": shape.name, "rows": rows}
    if json_out:
        out = Path(json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _budget_recipe(shape: ModelShape, specs: list[MethodSpec], recipe: str | None):
    """The recipe bit budgets read, checked against the shape planned; None when no method needs one."""
    budgets = [s.name for s in specs if s.budget is not None]
    if not budgets:
        return None
    if not recipe:
        raise MethodError(f"methods {', '.join(budgets)}: a bit budget's widths per layer and channel come from a "
                          "recipe of the model; pass --recipe DIR (made by `kvsqueeze calibrate`), or plan a fixed "
                          "method such as nuq3-1%")
    from ..recipe import Recipe

    loaded = Recipe.load(recipe)
    fp = loaded.meta["model"]["fingerprint"]
    have = (int(fp["layers"]), int(fp["kv_heads"]), int(fp["head_dim"]))
    if have != (shape.layers, shape.kv_heads, shape.head_dim):
        raise MethodError(f"recipe {recipe} is of a model with {have[0]} layers, {have[1]} KV heads of {have[2]} "
                          f"channels; {shape.name} has {shape.layers}, {shape.kv_heads} of {shape.head_dim}: plan "
                          "budgets with a recipe of the model planned")
    # the budget charges each layer for what it holds: its windows must be the ones the plan counts
    planned = list(shape.windows) if shape.windows is not None else [None] * shape.layers
    if "layer_windows" not in fp:  # a recipe from before its fingerprint named them: the planned model's
        fp["layer_windows"] = planned
    elif list(fp["layer_windows"]) != planned:
        raise MethodError(f"recipe {recipe} is of a model whose layers hold windows {fp['layer_windows']}; "
                          f"{shape.name} is planned with {planned}: plan its budgets with the config.json of the "
                          "model the recipe was calibrated on")
    return loaded


__all__ = [
    "BUILTIN_SHAPES", "ModelShape", "estimate_params", "format_table", "kv_cache_bytes",
    "parse_bytes", "parse_contexts", "parse_size", "plan", "resolve_model", "run_memory_command",
    "shape_from_config", "weight_bytes",
]
