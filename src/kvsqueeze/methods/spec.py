"""Method names: parse `nuq3-1%`, `int3:kchan:pre`, `kivi2`, ... into a frozen `MethodSpec`.

A method fixes everything about how the KV cache is quantized: the datatype
family (uniform int, NormalFloat, learned nuq codebooks, KIVI, grouped uniform),
key and value bit widths, the axis each is quantized along, whether keys are
quantized before or after RoPE, the outlier fraction and its scope, and how
many attention-sink tokens stay in fp16. What a method stores, builds and
runs on is its family's (`families.py`, the registry).

Grammar::

    FAMILY BITS [-PCT%] [:FLAG ...]      or      nuq@AVG [:sinkN] [:rN] [:kl] [:chan] [:ctxN]
    or a preset: q4.5 | q3.5 | q2.5 [:ctxN]  (`PRESETS`: the recommended methods, a budget of that many
    stored bits with an fp16 window (`preset_window`: 32 tokens, fewer on a layer that holds fewer than
    2,048) and a width per channel, chosen for the context N and the model's layers, `preset_for`)

    FAMILY  fp16 | int | nf | nuq | kivi | group | turbo
    AVG     a bit budget, e.g. 3.5: average stored bits per K/V element, every byte counted; each
            layer's key and value bit width and outlier fraction come from the recipe (`kvsqueeze.methods.budget`):
            from its Fisher objectives, or with `:kl` from measured sensitivities (`kvsqueeze budget`);
            with `:chan` every channel of every layer's keys and values gets its own width (1 to 6 bits)
            from the recipe's per-channel Fisher-weighted errors; `:kl:chan` scales each layer's key and
            value errors by their measured sensitivity; the choice holds AVG bits at the context it is chosen
            for, `DEFAULT_CONTEXT` tokens or `:ctxN` (e.g. `:ctx32k`, 32,768 tokens)
    BITS    2 | 3 | 4 (both K and V)  or  k3v2 (keys 3 bits, values 2 bits)
    PCT     outlier percentage, e.g. 1 or 0.1 (kept exactly in fp16)
    FLAG    ktok | kchan       keys per token / per channel
            vtok | vchan       values per token / per channel
            pre | post         keys quantized before / after RoPE
            pm | pv            outlier thresholds per matrix / per vector
            sinkN              first N tokens stay fp16 (sink0 disables)
            unw | fisher | fs2 nuq codebook fit: unweighted / Fisher / Fisher*s^2
            gN                 group size (kivi, group)
            rN                 the N most recent tokens read in fp16: KIVI's window (held instead of
                               codes), or nuq's (fp16 copies beside their codes, dropped as a token
                               leaves the window; a budget counts them, so `nuq@4.58:r16` stores
                               4.58 bits with the window)
            split              turbo: each head's higher-RMS half one bit wider (2.5 / 3.5 bits)

Family defaults follow the papers: `int`/`nf` are the per-token post-RoPE
baselines of KVQuant's tables; `nuq` is KVQuant (keys per channel pre-RoPE,
values per token, Fisher*s^2 codebooks, per-vector outliers, one sink);
`kivi` is KIVI (keys per channel in groups of 32 tokens post-RoPE, values per
token in groups of 32 channels, 128 recent tokens fp16); `group` is the
FlexGen/ATOM grouped per-token uniform quantizer (groups of 128 channels);
`turbo` is TurboQuant's MSE quantizer (`kvsqueeze.numerics.turbo`: a fixed random
rotation of each head vector, the optimal scalar codebook of the rotated
coordinates and an fp16 norm, keys after RoPE, nothing calibrated).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from ..numerics.outliers import fixed_outlier_count, max_outliers_per_side, topk_per_side  # noqa: F401  (re-exported)

FAMILIES = ("fp16", "int", "nf", "nuq", "kivi", "group", "turbo")
FIXED_AXES = ("kivi", "group", "turbo")  # families whose axes and RoPE side the paper fixes
SUPPORTED_BITS = (2, 3, 4)
# the context a bit budget is chosen for unless its name says (`:ctxN`): the calibration and evaluation length. A
# budget's metadata (codebooks, ranges, tables) is shared by every token, so the same choice stores more bits per
# element at a shorter context and fewer at a longer one; each budget is therefore chosen for one length.
DEFAULT_CONTEXT = 2048
MAX_CONTEXT = 1 << 24  # tokens a budget may be chosen for (16M)
MAX_FLAG = 1 << 20  # largest sink count, window, group or slot count a flag takes
FIT_VARIANTS = ("fs2", "fisher", "unw")  # Fisher*s^2 (the paper's), Fisher only, unweighted



class MethodError(ValueError):
    """A method name that does not parse or asks for something impossible."""


@dataclass(frozen=True)
class MethodSpec:
    """Everything that decides how one KV cache is quantized.

    Fields left at None take the family's defaults (`FAMILY_DEFAULTS`), so `MethodSpec("nuq", 3, 3)` is
    `parse_method("nuq3")`; `name` is always the canonical name.
    """

    family: str
    k_bits: int = 16
    v_bits: int = 16
    outlier_fraction: float = 0.0  # of the elements of each vector, half above and half below
    outlier_scope: str = "vector"  # "vector": per channel for K / per token for V; "matrix": one per layer
    key_axis: str | None = None  # the axis that shares one scale: "channel" or "token"
    key_rope: str | None = None  # quantize keys before ("pre") or after ("post") RoPE
    value_axis: str | None = None
    sinks: int | None = None  # first tokens kept in fp16 and left out of calibration
    fit: str = "fs2"
    group_size: int | None = None  # kivi / group only
    window: int | None = None  # kivi and nuq: recent tokens read in fp16 (kivi: instead of codes; nuq: beside them)
    split: bool = False  # turbo only: the higher-RMS half of each head's channels one bit wider
    budget: float | None = None  # nuq only: average stored bits; each layer's K / V choice from the recipe
    budget_proxy: str = "fisher"  # the loss a budget minimises: "fisher" objectives or measured "kl"
    budget_unit: str = "layer"  # what a budget gives its own bit width: each "layer" (K / V) or each "channel"
    context: int | None = None  # budgets: the cached tokens the choice is made for (None: `DEFAULT_CONTEXT`)
    key_slots: int = 0  # per-channel keys: exact elements per token, a fixed count (0: every outlier, a count that varies)
    name: str = field(default="", init=False, compare=False)

    def __post_init__(self) -> None:
        if self.family not in FAMILY_DEFAULTS:
            raise MethodError(f"unknown method family {self.family!r}; families: {', '.join(FAMILIES)}")
        for key, value in FAMILY_DEFAULTS[self.family].items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)
        if self.budget is not None and self.context is None:
            object.__setattr__(self, "context", DEFAULT_CONTEXT)
        if self.family != "fp16":
            for which, b in (("key", self.k_bits), ("value", self.v_bits)):
                if b not in SUPPORTED_BITS:
                    raise MethodError(f"{self.family}: {which} bit width {b} is not supported; use one of "
                                      f"{', '.join(map(str, SUPPORTED_BITS))}")
        object.__setattr__(self, "name", canonical_name(self))

    @property
    def quantized(self) -> bool:
        return self.family != "fp16"

    @property
    def reads_model_tensors(self) -> bool:
        """Whether it reads keys and values where the model makes them (every quantized method but KIVI, which
        quantizes inside attention)."""
        return self.quantized and self.family != "kivi"

    @property
    def pre_rope_keys(self) -> bool:
        """Whether it quantizes keys before RoPE, as the model hands them to its rotary step."""
        return self.reads_model_tensors and self.key_rope == "pre" and self.family != "group"

    @property
    def budget_context(self) -> int:
        """The cached tokens a budget's choice is made for."""
        return self.context or DEFAULT_CONTEXT  # a plain method's bits do not depend on it

    @property
    def pct_label(self) -> str:
        return _pct_label(self.outlier_fraction)


_NAME_RE = re.compile(
    r"^(?P<family>fp16|int|nf|nuq|kivi|group|turbo)"
    r"(?:@(?P<budget>\d+(?:\.\d+)?))?"
    r"(?:-?(?:(?P<bits>\d+)|k(?P<kb>\d+)v(?P<vb>\d+)))?"
    r"(?:-(?P<pct>\d+(?:\.\d+)?)%)?"
    r"(?P<flags>(?::[a-z0-9]+)*)$"
)

# Each family's defaults follow its paper (see the module docstring); every field a family leaves out is
# the same for all: keys per channel before RoPE, values per token, no sinks, no groups, no fp16 window.
_COMMON = dict(key_axis="channel", key_rope="pre", value_axis="token", sinks=0, group_size=0, window=0)
FAMILY_DEFAULTS = {
    "fp16": dict(_COMMON),
    "int": dict(_COMMON, key_axis="token", key_rope="post"),
    "nf": dict(_COMMON, key_axis="token", key_rope="post"),
    "nuq": dict(_COMMON, sinks=1),
    "kivi": dict(_COMMON, key_rope="post", group_size=32, window=128),
    "group": dict(_COMMON, key_axis="token", key_rope="post", group_size=128),
    "turbo": dict(_COMMON, key_axis="token", key_rope="post"),
}


def _pct_label(fraction: float) -> str:
    pct = fraction * 100
    return f"{pct:g}%"


def parse_method(name: str) -> MethodSpec:
    """Parse a method name (see the module docstring) into a `MethodSpec`.

    Raises:
        MethodError: the name does not follow the grammar, or asks for bit
            widths, fractions or flags that the family does not support, or
            gives a number more precisely than a method's name holds it.
    """
    spec = _parse_method(name)
    try:
        same = _parse_method(canonical_name(spec)) == spec
    except MethodError:
        same = False
    if not same:  # names key recipes' stored budgets, tables and logs: each must name one method
        raise MethodError(f"method {name!r}: its percentage or bit budget cannot be written back as a method name "
                          f"(it would read as {canonical_name(spec)!r}): give it with at most 6 significant digits "
                          "and no smaller than 0.0001")
    return spec


def _parse_method(name: str) -> MethodSpec:
    text = name.strip().lower()
    preset = _named_preset(text)
    if preset:  # without a model: chosen for one whose every layer keeps every token (`preset_for` takes the model's)
        return _preset(preset[0], preset[1] or DEFAULT_CONTEXT, ())
    m = _NAME_RE.match(text)
    if not m:
        raise MethodError(
            f"unknown method {name!r}: expected FAMILY BITS [-PCT%] [:FLAG...], e.g. "
            "'fp16', 'int3', 'nf4', 'nuq3-1%', 'nuq-k3v2-1%', 'kivi2', 'group3:g64', "
            "'int3:kchan:pre' (families: " + ", ".join(FAMILIES) + ")"
        )
    family = m["family"]
    fields: dict = dict(FAMILY_DEFAULTS[family])
    if family == "fp16":
        if m["bits"] or m["kb"] or m["pct"] or m["flags"]:
            raise MethodError(f"method {name!r}: 'fp16' takes no bits, outliers or flags")
        return MethodSpec(family="fp16")
    if m["budget"]:
        return _budget_method(name, family, m)
    if m["bits"]:
        kb = vb = int(m["bits"])
    elif m["kb"]:
        kb, vb = int(m["kb"]), int(m["vb"])
    else:
        raise MethodError(f"method {name!r}: give a bit width, e.g. '{family}3' or '{family}-k3v2'")
    for which, b in (("key", kb), ("value", vb)):
        if b not in SUPPORTED_BITS:
            raise MethodError(
                f"method {name!r}: {which} bit width {b} is not supported; use one of "
                f"{', '.join(map(str, SUPPORTED_BITS))}"
            )
    fields.update(k_bits=kb, v_bits=vb)
    if m["pct"]:
        pct = float(m["pct"])
        if not 0 < pct < 50:
            raise MethodError(f"method {name!r}: outlier percentage must be in (0, 50), got {pct}")
        if family in FIXED_AXES:
            raise MethodError(f"method {name!r}: {family} has no outlier option (KVQuant families only)")
        fields["outlier_fraction"] = pct / 100.0
    for flag in filter(None, m["flags"].split(":")):
        _apply_flag(name, family, flag, fields)
    spec = MethodSpec(family=family, **fields)
    if spec.key_slots and (spec.key_axis != "channel" or not spec.outlier_fraction or spec.outlier_scope != "vector"
                           or family in FIXED_AXES):
        raise MethodError(f"method {name!r}: ':kslots{spec.key_slots}' fixes the count of exact key elements per "
                          "token, for per-channel keys with per-channel outliers, e.g. 'nuq3-1%:kslots6'")
    if spec.outlier_scope == "matrix" and spec.outlier_fraction == 0:
        raise MethodError(f"method {name!r}: ':pm' sets per-matrix outlier thresholds; give a percentage, e.g. {family}{kb}-1%:pm")
    if family == "kivi":
        if spec.window < spec.group_size:
            raise MethodError(
                f"method {name!r}: the KIVI fp16 window ({spec.window}) must hold at least one key group "
                f"({spec.group_size} tokens), or quantized keys would use statistics of future tokens"
            )
        if spec.sinks:
            raise MethodError(f"method {name!r}: KIVI has no attention sinks; drop ':sink{spec.sinks}'")
    return spec


# The recommended methods, by the bits their cache stores: a per-channel budget with an fp16 window of recent
# tokens (`preset_window`), chosen for the context given with ':ctxN' (default `DEFAULT_CONTEXT`), e.g. 'q3.5:ctx32k',
# and for the tokens the model's layers hold (`preset_for`).
PRESETS = {"q4.5": "nuq@4.5:chan", "q3.5": "nuq@3.5:chan", "q2.5": "nuq@2.5:chan"}
_PRESET_RE = re.compile(r"^(?P<name>q\d+(?:\.\d+)?)(?P<ctx>:ctx\d+k?)?$")
# A preset's fp16 window: 1/64 of the tokens its model's fewest-holding layer keeps, at most 32. Each size was chosen
# on calibration text, by KL against fp16 at the same bits (`experiments/window_sweep.py`): 32 of 16 / 32 / 64 on
# SmolLM2-135M, whose layers hold all 2,048 tokens; 8 of 0 / 8 / 16 / 32 on Gemma-3-270M, whose sliding layers hold
# the last 511 of them. A larger window at longer contexts is untried, so 32 stays the most.
PRESET_WINDOW = 32
PRESET_WINDOW_SHARE = 64


def preset_window(context: int, layer_windows=()) -> int:
    """The fp16 window of a preset chosen for `context` tokens on a model whose layers keep `layer_windows` (each
    layer's sliding window, None where a layer keeps every token): 1/64 of the fewest tokens a layer holds, from 1
    to `PRESET_WINDOW` tokens."""
    fewest = min([context, *(w for w in layer_windows if w is not None)])
    return max(1, min(PRESET_WINDOW, fewest // PRESET_WINDOW_SHARE))


def _named_preset(text: str) -> tuple[str, int | None] | None:
    """(the preset, the context its ':ctxN' names, None without one) for a preset's name (lower case); None for any
    other name."""
    m = _PRESET_RE.match(text)
    if not m:
        return None
    if m["name"] not in PRESETS:
        raise MethodError(f"unknown preset {text!r}; presets: {', '.join(PRESETS)} (each with an optional "
                          "':ctxN', the context it is chosen for)")
    return m["name"], parse_method(PRESETS[m["name"]] + m["ctx"]).budget_context if m["ctx"] else None


def _preset(name: str, context: int, layer_windows) -> MethodSpec:
    return parse_method(f"{PRESETS[name]}:r{preset_window(context, layer_windows)}{context_flag(context)}")


def preset_for(name: str, context: int, layer_windows) -> MethodSpec:
    """A preset (`PRESETS`) chosen for `context` cached tokens on a model whose layers keep `layer_windows` (each
    layer's sliding window, None: every token; `kvsqueeze.integrations.parts.layer_windows(model)`, or a recipe's
    `budget.recipe_windows`); any other method name as it parses (a preset with ':ctxN' for that context)."""
    preset = _named_preset(name.strip().lower())
    if preset:
        return _preset(preset[0], preset[1] or context, layer_windows)
    return parse_method(name)


def preset_reaching(name: str, tokens: int, layer_windows) -> MethodSpec:
    """A preset chosen for a cache that reaches `tokens` tokens (a generation's prompt and new tokens, an evaluation
    window), never for fewer than `DEFAULT_CONTEXT`: a shorter cache holds the 2,048-token choice, its window paid
    over fewer tokens, as its memory report says; on a model whose layers keep `layer_windows` (`preset_for`). Any
    other method name as it parses."""
    return preset_for(name, max(DEFAULT_CONTEXT, tokens), layer_windows)


def _budget_method(name: str, family: str, m: re.Match) -> MethodSpec:
    """`nuq@AVG[:sinkN]`: a bit budget (its bits and outliers per layer come from the recipe)."""
    if family != "nuq":
        raise MethodError(f"method {name!r}: a bit budget ('@AVG') chooses nuq codebooks per layer; "
                          f"use 'nuq@{m['budget']}'")
    if m["bits"] or m["kb"] or m["pct"]:
        raise MethodError(f"method {name!r}: a bit budget chooses each layer's bits and outliers itself; drop "
                          "the bit width and percentage, e.g. 'nuq@3.5'")
    budget = float(m["budget"])
    if not 2.0 <= budget <= 16.0:
        raise MethodError(f"method {name!r}: the budget is average stored bits per element, between 2 and 16")
    fields: dict = dict(FAMILY_DEFAULTS[family])
    proxy, unit = "fisher", "layer"
    for flag in filter(None, m["flags"].split(":")):
        if flag == "kl":
            proxy = "kl"
            continue
        if flag == "chan":
            unit = "channel"
            continue
        m_ctx = re.fullmatch(r"ctx(\d+)(k?)", flag)
        if m_ctx:
            context = int(m_ctx[1]) * (1024 if m_ctx[2] else 1)
            if not 1 <= context <= MAX_CONTEXT:
                raise MethodError(f"method {name!r}: ':{flag}' chooses the budget for {context} cached tokens; give "
                                  f"1 to {MAX_CONTEXT} (e.g. ':ctx32k')")
            fields["context"] = context
            continue
        if not re.fullmatch(r"(sink|r|kslots)\d+", flag):
            raise MethodError(f"method {name!r}: a bit budget takes a sink count (':sinkN'), an fp16 window "
                              f"(':rN'), ':kl' (measured sensitivities), ':chan' (a bit width per channel), the "
                              f"context it is chosen for (':ctxN', e.g. ':ctx32k') and a fixed count of exact key "
                              f"elements per token in the layers that keep key outliers (':kslotsN'), "
                              f"not ':{flag}'")
        _apply_flag(name, family, flag, fields)
    # the widest choice stands in for the spec's own bits; every consumer reads the layer's choice instead
    return MethodSpec(family=family, **{**fields, "k_bits": max(SUPPORTED_BITS), "v_bits": max(SUPPORTED_BITS)},
                      budget=budget, budget_proxy=proxy, budget_unit=unit)


def _apply_flag(name: str, family: str, flag: str, fields: dict) -> None:
    simple = {
        "ktok": ("key_axis", "token"),
        "kchan": ("key_axis", "channel"),
        "vtok": ("value_axis", "token"),
        "vchan": ("value_axis", "channel"),
        "pre": ("key_rope", "pre"),
        "post": ("key_rope", "post"),
        "pm": ("outlier_scope", "matrix"),
        "pv": ("outlier_scope", "vector"),
        "unw": ("fit", "unw"),
        "fisher": ("fit", "fisher"),
        "fs2": ("fit", "fs2"),
    }
    if flag in simple:
        key, value = simple[flag]
        if family in FIXED_AXES and key in ("key_axis", "value_axis", "key_rope"):
            raise MethodError(f"method {name!r}: {family} has fixed axes; flag ':{flag}' does not apply")
        if key == "fit" and family != "nuq":
            raise MethodError(f"method {name!r}: ':{flag}' chooses a nuq codebook fit; {family} has standard levels")
        fields[key] = value
        return
    if flag == "split":
        if family != "turbo":
            raise MethodError(f"method {name!r}: ':split' gives turbo's outlier half one bit more; {family} has none")
        fields["split"] = True
        return
    m = re.fullmatch(r"(sink|g|r|kslots)(\d+)", flag)
    if not m:
        raise MethodError(
            f"method {name!r}: unknown flag ':{flag}'; known flags: ktok kchan vtok vchan pre post "
            "pm pv sinkN unw fisher fs2 gN rN split kslotsN"
        )
    kind, n = m[1], int(m[2])
    if n > MAX_FLAG:
        raise MethodError(f"method {name!r}: ':{flag}' is out of range; {kind}N takes at most {MAX_FLAG}")
    if kind == "kslots":
        fields["key_slots"] = n
    elif kind == "sink":
        fields["sinks"] = n
    elif kind == "g":
        if family not in ("kivi", "group") or n < 1:
            raise MethodError(f"method {name!r}: ':g{n}' sets a positive group size for kivi/group only")
        fields["group_size"] = n
    else:
        if family not in ("kivi", "nuq"):
            raise MethodError(f"method {name!r}: ':r{n}' sets the fp16 window of recent tokens of kivi and nuq; "
                              f"{family} has none")
        fields["window"] = n


def canonical_name(spec: MethodSpec) -> str:
    """The shortest name that parses back to `spec` (flags only where they differ from the family default)."""
    if spec.family == "fp16":
        return "fp16"
    if spec.budget is not None:
        sinks = FAMILY_DEFAULTS[spec.family].get("sinks", 0)
        return (f"{spec.family}@{spec.budget:g}" + (f":sink{spec.sinks}" if spec.sinks != sinks else "")
                + (f":r{spec.window}" if spec.window else "") + (":kl" if spec.budget_proxy == "kl" else "")
                + (":chan" if spec.budget_unit == "channel" else "") + context_flag(spec.budget_context)
                + (f":kslots{spec.key_slots}" if spec.key_slots else ""))
    bits = str(spec.k_bits) if spec.k_bits == spec.v_bits else f"-k{spec.k_bits}v{spec.v_bits}"
    out = spec.family + bits
    if spec.outlier_fraction:
        out += "-" + _pct_label(spec.outlier_fraction)
    d = FAMILY_DEFAULTS[spec.family]
    flags = []
    if spec.family not in FIXED_AXES:
        if spec.key_axis != d["key_axis"]:
            flags.append("ktok" if spec.key_axis == "token" else "kchan")
        if spec.key_rope != d["key_rope"]:
            flags.append(spec.key_rope)
        if spec.value_axis != d["value_axis"]:
            flags.append("vtok" if spec.value_axis == "token" else "vchan")
    if spec.outlier_fraction and spec.outlier_scope == "matrix":
        flags.append("pm")
    if spec.sinks != d.get("sinks", 0):
        flags.append(f"sink{spec.sinks}")
    if spec.family == "nuq" and spec.fit != "fs2":
        flags.append(spec.fit)
    if spec.family in ("kivi", "group") and spec.group_size != d["group_size"]:
        flags.append(f"g{spec.group_size}")
    if spec.family in ("kivi", "nuq") and spec.window != d["window"]:
        flags.append(f"r{spec.window}")
    if spec.split:
        flags.append("split")
    if spec.key_slots:
        flags.append(f"kslots{spec.key_slots}")
    return out + "".join(":" + f for f in flags)


def context_flag(context: int) -> str:
    """':ctxN' for a budget chosen for another context than `DEFAULT_CONTEXT` ('' for that one)."""
    if context == DEFAULT_CONTEXT:
        return ""
    return f":ctx{context // 1024}k" if context % 1024 == 0 else f":ctx{context}"


def parse_methods(text: str, reaching: int | None = None, context: int | None = None,
                  layer_windows=None) -> list[MethodSpec]:
    """Parse a comma-separated list of method names, rejecting duplicates; with `reaching`, each preset is chosen
    for a cache of that many tokens (`preset_reaching`), with `context` for exactly that many (`preset_for`), on a
    model whose layers keep `layer_windows` (each layer's sliding window, None: every token; `()` for a model
    whose every layer keeps every token), and two names that come to the same method there are duplicates too.
    Without a context the names parse as `parse_method` reads them, presets for a model whose layers keep every
    token unless `layer_windows` says otherwise."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise MethodError("no methods given: pass e.g. --methods fp16,int3,nuq3-1%")
    if reaching is not None and context is not None:
        raise ValueError("parse_methods: give `reaching` or `context`, not both")
    if (reaching is not None or context is not None) and layer_windows is None:
        raise TypeError("parse_methods: presets chosen for a context follow the model's layers; give layer_windows "
                        "(`()` where every layer keeps every token)")
    windows = layer_windows or ()
    specs = [preset_reaching(n, reaching, windows) if reaching is not None
             else preset_for(n, context, windows) if context is not None
             else preset_for(n, DEFAULT_CONTEXT, windows) for n in names]
    seen: dict[str, str] = {}
    for raw, s in zip(names, specs):
        if s.name in seen:
            raise MethodError(f"methods {seen[s.name]!r} and {raw!r} are the same method ({s.name})")
        seen[s.name] = raw
    return specs
