"""The calibration artifact: `recipe.safetensors` (tensors) + `recipe.json` (settings), never pickle.

A recipe holds, for every layer, the offline statistics KVQuant calibrates:
per-channel key ranges (pre- and post-RoPE) and value ranges for each outlier
fraction, per-matrix outlier thresholds, and the learned nuq codebooks for
each bit width, outlier setting and fit variant. The JSON side records the
format version, the model it was calibrated on (id, shapes and a weight
fingerprint of every layer), the calibration settings, timings and k-means objectives.

A recipe is whole or absent: `save` writes both files whole to staging names in the same directory, then
renames them into place under a lock (a save stopped between the two renames is finished by the next `load`),
and the JSON carries a checksum of the tensors and one of itself, so two writers or an edit show at `load`.
`save` refuses what `load` would refuse, and `load` checks every field it reads (`check`) before anything uses
it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

FORMAT_VERSION = 2  # 2: the JSON's own checksum (`meta_sha256`) and every layer's weights in the fingerprint
TENSORS_FILE = "recipe.safetensors"
META_FILE = "recipe.json"
LOCK_FILE = ".recipe.lock"  # held while a pair of files is renamed into place (or read)
RUN_LOCK_FILE = ".calibrate.lock"  # held by a calibration for its whole run


class RecipeError(ValueError):
    """A recipe that is missing, corrupted, or does not belong to the model at hand."""


def pct_tag(fraction: float) -> str:
    """Key fragment for an outlier fraction: 0.01 -> 'p1', 0.001 -> 'p0.1', 0 -> 'p0'."""
    return f"p{fraction * 100:g}"


def range_key(layer: int, tensor: str, fraction: float) -> str:
    """Per-channel [2, C] range (lo, hi) of `tensor` in {'k_pre', 'k_post', 'v'}."""
    return f"layers.{layer}.{tensor}.range.{pct_tag(fraction)}"


def matrix_key(layer: int, tensor: str, fraction: float) -> str:
    """Per-matrix [2] outlier thresholds (lo, hi)."""
    return f"layers.{layer}.{tensor}.matrix.{pct_tag(fraction)}"


def codebook_key(layer: int, kv: str, bits: int, fraction: float, scope: str, fit: str) -> str:
    return f"layers.{layer}.codebook.{kv}.b{bits}.{pct_tag(fraction)}.{scope}.{fit}"


def channel_error_key(layer: int, kv: str, fraction: float) -> str:
    """Per-channel [C, widths] Fisher-weighted squared error of `kv` at each width of `budget.CHANNEL_BITS`."""
    return f"layers.{layer}.chanerr.{kv}.{pct_tag(fraction)}"


PROBES = 16  # key weights the fingerprint keeps of each layer, evenly spaced over the matrix
# (the fingerprint itself is taken from the model by `kvsqueeze.integrations.fingerprint`)
PROBE_RTOL = 2.0**-7  # 4x bf16's rounding error: the same weights in fp32, bf16 or fp16 agree within it
PROBE_ATOL = 2.0**-24  # fp16's subnormal spacing


def _close(a, b) -> bool:
    """Whether two lists of probed weights agree within a change of precision (False for anything else)."""
    if not isinstance(a, list) or not isinstance(b, list) or len(a) != len(b) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in (*a, *b)):
        return False
    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return bool(((x - y).abs() <= PROBE_RTOL * torch.maximum(x.abs(), y.abs()) + PROBE_ATOL).all())


def key_digest(layer: int, weight: torch.Tensor) -> tuple[str, list[float]]:
    """Layer `layer`'s entry of a fingerprint from its key projection's weights [C, hidden]: a hash of them in
    float32 and `PROBES` of them evenly spaced over the matrix (what `recipe.same_weights` compares)."""
    flat = weight.detach().float().cpu().contiguous().view(-1)
    if not torch.isfinite(flat).all():
        raise RecipeError(f"layer {layer}'s key projection holds NaN/Inf weights: the model's weights are broken "
                          "(a bad download or conversion); load a sound copy of the model")
    probe = flat[probe_positions(flat.numel(), torch.float32)].tolist()
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16], probe


def probe_positions(n: int, dtype: torch.dtype, count: int = PROBES) -> torch.Tensor:
    """`PROBES` positions evenly spaced over n elements (int64), spaced in `dtype` and kept inside the tensor.

    The dtype is always named: vLLM loads weights under its model dtype as torch's default, where bf16 or fp16
    positions would round past the end or overflow, and differ from the ones the recipe was probed at. Key
    probes are spaced in float32, as every recipe's were; tensor probes in float64. In float32 the last
    position of a tensor past 2**24 elements rounds out of range, hence the clamp (it then equals float64's)."""
    return torch.linspace(0, n - 1, min(count, n), dtype=dtype).round().long().clamp_(0, n - 1)


def tensor_probe(weight: torch.Tensor) -> list[float]:
    """`PROBES` elements of a weight tensor, evenly spaced over it in float32 (what `other_tensors` compares)."""
    flat = weight.detach().reshape(-1)
    return flat[probe_positions(flat.numel(), torch.float64).to(flat.device)].float().cpu().tolist()


def other_tensors(recipe_probes: dict, model_probes: dict) -> list[str]:
    """The tensors, by name, whose probed elements differ between a recipe's fingerprint and a model's by more than
    a change of precision would (only names both hold are compared: a checkpoint may name a tied head or not)."""
    return [name for name in sorted(set(recipe_probes) & set(model_probes))
            if not _close(recipe_probes[name], model_probes[name])]


def same_weights(recipe_fp: dict, model_fp: dict) -> list[int]:
    """The layers whose key weights differ between two fingerprints of equal shapes (empty: the same weights,
    possibly at another precision).

    Each layer's hash tells equal weights apart exactly; a model calibrated in fp32 and served in bf16 or fp16
    hashes otherwise, but its probed weights agree within that precision's rounding.
    """
    want_h, have_h = recipe_fp.get("layers_sha256"), model_fp["layers_sha256"]
    want_p, have_p = recipe_fp.get("layers_probe"), model_fp["layers_probe"]
    if not isinstance(want_h, list) or len(want_h) != len(have_h):
        return list(range(len(have_h)))
    probes = want_p if isinstance(want_p, list) and len(want_p) == len(have_p) else [None] * len(have_p)
    return [i for i, (a, b, pa, pb) in enumerate(zip(want_h, have_h, probes, have_p))
            if a != b and not _close(pa, pb)]


@dataclass
class Recipe:
    """Offline calibration statistics for one model."""

    meta: dict
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    # ---- lookups -------------------------------------------------------------------------
    def _get(self, key: str, hint: str) -> torch.Tensor:
        if key not in self.tensors:
            s = self.meta.get("settings", {})
            if (key.endswith((".fisher", ".unw")) or ".matrix." in key) and not s.get("ablation", True):
                raise RecipeError(f"recipe has no entry {key!r} ({hint}): only the ablation ladder reads it; "
                                  "recalibrate with `kvsqueeze calibrate --ablation`")
            raise RecipeError(
                f"recipe has no entry {key!r} ({hint}); it was calibrated with bits={s.get('bits')}, "
                f"outlier fractions={s.get('fractions')}: recalibrate with the settings this method needs"
            )
        return self.tensors[key]

    def channel_range(self, layer: int, tensor: str, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
        r = self._get(range_key(layer, tensor, fraction), f"per-channel {tensor} range")
        return r[0], r[1]

    def matrix_thresholds(self, layer: int, tensor: str, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
        r = self._get(matrix_key(layer, tensor, fraction), f"per-matrix {tensor} thresholds")
        return r[0], r[1]

    def codebook(self, layer: int, kv: str, bits: int, fraction: float, scope: str, fit: str) -> torch.Tensor:
        return self._get(codebook_key(layer, kv, bits, fraction, scope, fit), f"{bits}-bit {kv} codebook")

    def channel_errors(self, layer: int, kv: str, fraction: float) -> torch.Tensor:
        key = channel_error_key(layer, kv, fraction)
        if key not in self.tensors:
            raise RecipeError(f"recipe has no per-channel errors {key!r}, which ':chan' bit budgets read: "
                              "recalibrate it with this version of kvsqueeze (`kvsqueeze calibrate`)")
        return self.tensors[key]

    # ---- model check ---------------------------------------------------------------------
    def check_fingerprint(self, have: dict) -> None:
        """Raise RecipeError unless this recipe was calibrated on the model of fingerprint `have` (at any of fp32,
        bf16, fp16); `kvsqueeze.integrations.fingerprint.check_recipe` takes the model itself."""
        want = self.meta.get("model", {}).get("fingerprint", {})
        weights = ("layers_sha256", "layers_probe", "weights_probe")
        # a recipe from before the fingerprint named each layer's sliding window: the same weights are the same
        # model, whose windows it takes (what its bit budgets charge each layer for), below, once they match
        unnamed = "layer_windows" in have and "layer_windows" not in want
        later = ("rope",)  # fields a recipe from before them does not hold: not compared there
        diff = [f"{k}: recipe {want.get(k)} vs model {have[k]}" for k in have
                if k not in weights and want.get(k) != have[k] and not (k == "layer_windows" and unnamed)
                and not (k in later and k not in want)]
        if not diff:
            layers = same_weights(want, have)
            if layers:
                shown = ", ".join(map(str, layers[:8])) + (" ..." if len(layers) > 8 else "")
                diff = [f"the key weights of layer(s) {shown} differ by more than a change of precision would "
                        "(layers_sha256)"]
        if not diff and isinstance(want.get("weights_probe"), dict) and "weights_probe" in have:
            names = other_tensors(want["weights_probe"], have["weights_probe"])
            if names:  # e.g. a fine-tune that left the key projections alone (LoRA on queries and values)
                shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
                diff = [f"the weights of {shown} differ by more than a change of precision would (weights_probe)"]
        if diff:
            raise RecipeError(
                f"recipe was calibrated on model {self.meta.get('model', {}).get('id')!r}, not on this one "
                f"({'; '.join(diff)}); run `kvsqueeze calibrate` for this model"
            )
        if unnamed:
            want["layer_windows"] = list(have["layer_windows"])

    # ---- files ---------------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        """Write both files whole: both staged, then renamed into place, under the directory's lock; the JSON's
        checksums cover the tensors and the JSON itself. A recipe `check` refuses is not written."""
        from safetensors.torch import save

        self.check()  # a recipe that `load` would refuse is not written over a good one
        d = check_directory(directory)
        tensors = {k: v.detach().float().cpu().contiguous() for k, v in self.tensors.items()}
        data = save(tensors, metadata={"format_version": str(FORMAT_VERSION)})
        meta = {k: v for k, v in self.meta.items() if k != "meta_sha256"}
        meta.update(format_version=FORMAT_VERSION, tensors_sha256=hashlib.sha256(data).hexdigest())
        meta["meta_sha256"] = meta_digest(meta)
        try:
            text = json.dumps(meta, indent=2, sort_keys=True, allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise RecipeError(f"the recipe's settings cannot be written as JSON ({exc})") from exc
        with writing(d):
            # both files staged whole before either is renamed into place; a save stopped between the two renames
            # leaves the staged JSON, which `load` renames into place (`_finish_save`)
            staged = [(_stage(d / name, payload), d / name)
                      for name, payload in ((TENSORS_FILE, data), (META_FILE, text))]
            for tmp, path in staged:
                os.replace(tmp, path)
        return d

    @classmethod
    def load(cls, directory: str | Path) -> "Recipe":
        from safetensors.torch import load

        d = Path(directory)
        _finish_save(d)
        if not (d / META_FILE).is_file() or not (d / TENSORS_FILE).is_file():
            raise RecipeError(
                f"{d} is not a recipe: expected {META_FILE} and {TENSORS_FILE} there "
                "(create one with `kvsqueeze calibrate --out DIR`)"
            )
        with writing(d, shared=True):  # not while another process renames a new pair into place
            raw, data = (d / META_FILE).read_bytes(), (d / TENSORS_FILE).read_bytes()
        try:
            meta = json.loads(raw, parse_constant=_no_constant)
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
            raise RecipeError(f"{d / META_FILE} is corrupted ({exc}); recalibrate or restore the file") from exc
        if not isinstance(meta, dict):
            raise RecipeError(f"{d / META_FILE} does not hold a recipe (a JSON object); recalibrate or restore the file")
        version = meta.get("format_version")
        if version != FORMAT_VERSION:
            raise RecipeError(
                f"{d} has recipe format version {version!r}; this kvsqueeze reads version {FORMAT_VERSION}: recalibrate"
                + (" (or `kvsqueeze upgrade-recipe` it)" if version == 1 else "")
            )
        if meta.get("meta_sha256") != meta_digest(meta):
            raise RecipeError(f"{d / META_FILE} does not match its own checksum (meta_sha256): it was edited or "
                              "half-written; recalibrate or restore it")
        if meta.get("tensors_sha256") != hashlib.sha256(data).hexdigest():
            raise RecipeError(
                f"{d / TENSORS_FILE} does not match the checksum in {META_FILE}: the file is corrupted or was "
                "replaced; recalibrate or restore both files together"
            )
        try:
            tensors = load(data)
        except Exception as exc:  # safetensors raises its own error types for truncated or bad headers
            raise RecipeError(f"{d / TENSORS_FILE} cannot be read ({exc}); recalibrate") from exc
        recipe = cls(meta=meta, tensors=tensors)
        recipe.check()
        return recipe

    def check(self) -> None:
        """Raise RecipeError naming the first field that is missing, of the wrong type or out of range."""
        _check_meta(self.meta)
        _check_tensors(self.meta, self.tensors)


def meta_digest(meta: dict) -> str:
    """The checksum of a recipe's JSON: every field but itself, keys sorted."""
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number a recipe holds")


def check_directory(directory: str | Path) -> Path:
    """`directory`, created if need be, once it is known to be a writable directory (RecipeError otherwise)."""
    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise RecipeError(f"{d} is a file, not a directory: give --out a directory for the recipe")
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RecipeError(f"cannot create the recipe directory {d} ({exc.strerror}): give another --out") from exc
    if not os.access(d, os.W_OK):
        raise RecipeError(f"the recipe directory {d} is not writable: give another --out")
    return d


_HELD: dict[str, int] = {}  # directories this process holds the lock of, and how deep


@contextlib.contextmanager
def writing(directory: str | Path, shared: bool = False, wait: bool = True, lock: str = LOCK_FILE):
    """Hold `directory`'s lock `lock` (exclusive to write, shared to read); with wait=False raise RecipeError at
    once if another process holds it. Re-entrant within a process."""
    d = Path(directory)
    key = str((d / lock).resolve())
    if key in _HELD:
        _HELD[key] += 1
        try:
            yield
        finally:
            _HELD[key] -= 1
        return
    try:
        import fcntl
    except ImportError:  # no advisory locks here: the atomic renames and the checksums still hold
        yield
        return
    try:
        fd = os.open(d / lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        if shared:  # a read-only directory: nobody writes there either
            yield
            return
        raise
    try:
        mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        try:
            fcntl.flock(fd, mode | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError as exc:
            raise RecipeError(f"another kvsqueeze process is writing a recipe to {d}: wait for it or give another "
                              "--out") from exc
        _HELD[key] = 1
        try:
            yield
        finally:
            del _HELD[key]
    finally:
        os.close(fd)


def _staged(path: Path) -> Path:
    return path.with_name(f".{path.name}.staged")


def _stage(path: Path, data: bytes) -> Path:
    """`data` written whole and flushed to disk under `path`'s staging name (the caller holds the lock)."""
    tmp = _staged(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def _finish_save(d: Path) -> None:
    """A save stopped part way: its tensors renamed into place and its JSON still staged (both were staged whole
    first) is finished by renaming the JSON; a save stopped before its first rename left the old pair whole, and
    its staged files are dropped."""
    meta, tensors = _staged(d / META_FILE), _staged(d / TENSORS_FILE)
    if not meta.exists() and not tensors.exists():
        return
    try:
        with writing(d):
            if meta.exists() and not tensors.exists():
                os.replace(meta, d / META_FILE)
            else:
                for tmp in (meta, tensors):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp)
    except OSError as exc:
        raise RecipeError(f"{d}: a save of this recipe stopped part way and the directory cannot be written to finish "
                          f"it ({exc}); make it writable, or recalibrate") from exc


# ---- what `Recipe.check` holds a recipe to --------------------------------------------------------------------
MAX_FRACTION = 0.5  # outliers are a minority of each vector
MAX_WIDTH = 8  # a code is at most a byte (`numerics.packing.MAX_BITS`); budgets' channel widths stop at 6
SHAPE_FIELDS = ("layers", "heads", "kv_heads", "head_dim", "hidden_size", "vocab_size")
_TENSOR = re.compile(r"layers\.(\d+)\.(?:(k_pre|k_post|v)\.(range|matrix)\.p[0-9.e-]+"
                     r"|codebook\.([kv])\.b(\d+)\.p[0-9.e-]+\.(vector|matrix)\.(\w+)|chanerr\.([kv])\.p[0-9.e-]+)$")


def _fail(field: str, problem: str):
    raise RecipeError(f"recipe field {field} {problem}; recalibrate or restore the recipe")


def _int(x, field: str, lo: int = 0, hi: int | None = None) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or x < lo or (hi is not None and x > hi):
        _fail(field, f"is {x!r}, not an integer in [{lo}, {'inf' if hi is None else hi}]")
    return x


def _number(x, field: str, lo: float = -math.inf, hi: float = math.inf) -> float:
    if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x) or not lo <= x <= hi:
        _fail(field, f"is {x!r}, not a finite number in [{lo:g}, {hi:g}]")
    return float(x)


def _kind(x, kind, field: str):
    if not isinstance(x, kind):
        _fail(field, f"is {type(x).__name__} {x!r:.60}, not {getattr(kind, '__name__', kind)}")
    return x


def _check_meta(meta: dict) -> None:
    model = _kind(meta.get("model"), dict, "model")
    _kind(model.get("id"), str, "model.id")
    _kind(meta.get("text"), str, "text")
    fp = _kind(model.get("fingerprint"), dict, "model.fingerprint")
    for k in SHAPE_FIELDS:
        _int(fp.get(k), f"model.fingerprint.{k}", 1)
    layers = fp["layers"]
    hashes = _kind(fp.get("layers_sha256"), list, "model.fingerprint.layers_sha256")
    probes = _kind(fp.get("layers_probe"), list, "model.fingerprint.layers_probe")
    if len(hashes) != layers or len(probes) != layers:
        _fail("model.fingerprint.layers_sha256", f"covers {len(hashes)} layers ({len(probes)} probed), not {layers}")
    for i, (h, pr) in enumerate(zip(hashes, probes)):
        _kind(h, str, f"model.fingerprint.layers_sha256[{i}]")
        for j, v in enumerate(_kind(pr, list, f"model.fingerprint.layers_probe[{i}]")):
            _number(v, f"model.fingerprint.layers_probe[{i}][{j}]")
    if "weights_probe" in fp:  # every tensor's probed elements (recipes from before it have none)
        for name, pr in _kind(fp["weights_probe"], dict, "model.fingerprint.weights_probe").items():
            for j, v in enumerate(_kind(pr, list, f"model.fingerprint.weights_probe.{name}")):
                _number(v, f"model.fingerprint.weights_probe.{name}[{j}]")
    if "layer_windows" in fp:  # recipes from before it have only full layers, or take it from their model
        windows = _kind(fp["layer_windows"], list, "model.fingerprint.layer_windows")
        if len(windows) != layers:
            _fail("model.fingerprint.layer_windows", f"covers {len(windows)} layers, not {layers}")
        for i, w in enumerate(windows):
            if w is not None:
                _int(w, f"model.fingerprint.layer_windows[{i}]", 2)
    settings = _kind(meta.get("settings"), dict, "settings")
    for k in ("samples", "seqlen", "bins"):
        _int(settings.get(k), f"settings.{k}", 1)
    _int(settings.get("sinks"), "settings.sinks", 0)
    bits = _kind(settings.get("bits"), list, "settings.bits")
    if not bits:
        _fail("settings.bits", "is empty")
    for i, b in enumerate(bits):
        _int(b, f"settings.bits[{i}]", 1, MAX_WIDTH)
    fractions = _kind(settings.get("fractions"), list, "settings.fractions")
    for i, f in enumerate(fractions):
        _number(f, f"settings.fractions[{i}]", 0.0, MAX_FRACTION)
    for i, f in enumerate(_kind(settings.get("fits"), list, "settings.fits")):
        _kind(f, str, f"settings.fits[{i}]")
    _kind(settings.get("ablation", False), bool, "settings.ablation")
    channels = fp["kv_heads"] * fp["head_dim"]
    for name, alloc in _kind(meta.get("budgets", {}), dict, "budgets").items():
        _check_budget(_kind(alloc, dict, f"budgets.{name}"), f"budgets.{name}", layers, channels)
    for key, table in _kind(meta.get("sensitivity", {}), dict, "sensitivity").items():
        at = f"sensitivity.{key}"
        _kind(table, dict, at)
        for k in ("bits", "fractions"):
            for i, v in enumerate(_kind(table.get(k), list, f"{at}.{k}")):
                _number(v, f"{at}.{k}[{i}]", 0.0, MAX_WIDTH)
        for unit, kl in _kind(table.get("kl"), dict, f"{at}.kl").items():
            _number(kl, f"{at}.kl.{unit}", 0.0)
    for key, objective in _kind(meta.get("kmeans_objective", {}), dict, "kmeans_objective").items():
        for name, v in _kind(objective, dict, f"kmeans_objective.{key}").items():
            _number(v, f"kmeans_objective.{key}.{name}", 0.0)
    for i, piece in enumerate(_kind(meta.get("calibration_pieces", []), list, "calibration_pieces")):
        _kind(piece, str, f"calibration_pieces[{i}]")


def _check_budget(alloc: dict, field: str, layers: int, channels: int) -> None:
    _number(alloc.get("avg_bits"), f"{field}.avg_bits", 0.0, 64.0)
    _number(alloc.get("bits"), f"{field}.bits", 0.0, 64.0)
    _number(alloc.get("predicted"), f"{field}.predicted", 0.0)
    _int(alloc.get("tokens"), f"{field}.tokens", 1)
    _int(alloc.get("window", 0), f"{field}.window", 0)
    for side in ("keys", "values"):
        rows = _kind(alloc.get(side), list, f"{field}.{side}")
        if len(rows) != layers:
            _fail(f"{field}.{side}", f"has {len(rows)} layers, the model {layers}")
        for i, row in enumerate(rows):
            at = f"{field}.{side}[{i}]"
            if not isinstance(row, list) or len(row) not in (2, 3):
                _fail(at, f"is {row!r:.60}, not [bits, fraction] or [bits, fraction, widths]")
            _int(row[0], f"{at}[0] (bits)", 1, 6)
            _number(row[1], f"{at}[1] (outlier fraction)", 0.0, MAX_FRACTION)
            if len(row) == 3:
                widths = _kind(row[2], list, f"{at}[2] (channel widths)")
                if len(widths) != channels:
                    _fail(f"{at}[2] (channel widths)", f"has {len(widths)} channels, the model {channels}")
                for w in widths:
                    _int(w, f"{at}[2] (channel widths)", 1, 6)


def _check_tensors(meta: dict, tensors: dict) -> None:
    fp = meta["model"]["fingerprint"]
    layers, channels = fp["layers"], fp["kv_heads"] * fp["head_dim"]
    for key, t in tensors.items():
        m = _TENSOR.match(key)
        if m is None:
            _fail(f"tensor {key!r}", "is not one a recipe holds")
        if int(m.group(1)) >= layers:
            _fail(f"tensor {key!r}", f"names a layer past the model's {layers}")
        if t.dtype not in (torch.float32, torch.float64):
            _fail(f"tensor {key!r}", f"has dtype {t.dtype}, not torch.float32 (what `Recipe.save` writes)")
        if not torch.isfinite(t).all():
            _fail(f"tensor {key!r}", "holds NaN/Inf")
        if m.group(3) == "range":
            if t.shape != (2, channels):
                _fail(f"tensor {key!r}", f"has shape {tuple(t.shape)}, not (2, {channels}) (lo, hi per channel)")
            if (t[0] > t[1]).any():
                _fail(f"tensor {key!r}", f"has lo > hi in {int((t[0] > t[1]).sum())} channel(s)")
            if (t[0] == t[1]).all():
                _fail(f"tensor {key!r}", "has an empty range (lo == hi) in every channel")
        elif m.group(3) == "matrix":
            if t.shape != (2,) or not t[0] < t[1]:
                _fail(f"tensor {key!r}", f"is {t.tolist()}, not the thresholds [lo, hi] with lo < hi")
        elif m.group(4):
            bits = int(m.group(5))
            if bits > MAX_WIDTH or t.shape != (2**bits,):
                _fail(f"tensor {key!r}", f"has shape {tuple(t.shape)}, not ({2**bits},) levels")
            if (t[1:] <= t[:-1]).any() or t.abs().max() > 1 + 1e-6:
                _fail(f"tensor {key!r}", "is not a codebook: its levels must rise strictly within [-1, 1]")
        elif t.ndim != 2 or t.shape[0] != channels or (t < 0).any():
            _fail(f"tensor {key!r}", f"has shape {tuple(t.shape)}, not ({channels}, widths) of errors >= 0")
    _check_nesting(tensors)


def _check_nesting(tensors: dict) -> None:
    """A range that leaves a larger share of outliers out lies inside one that leaves less (each channel), and
    per-matrix thresholds inside the whole range: what calibration gives, whatever the data."""
    by_vector: dict[tuple, list] = {}
    for key, t in tensors.items():
        m = re.match(r"layers\.(\d+)\.(k_pre|k_post|v)\.(range|matrix)\.p([0-9.e-]+)$", key)
        if m:
            by_vector.setdefault((m.group(1), m.group(2)), []).append((m.group(3), float(m.group(4)), key, t))
    for (layer, name), items in by_vector.items():
        ranges = sorted((p, key, t) for kind, p, key, t in items if kind == "range")
        for (_, outer_key, outer), (_, inner_key, inner) in zip(ranges, ranges[1:]):
            if (inner[0] < outer[0]).any() or (inner[1] > outer[1]).any():
                _fail(f"tensor {inner_key!r}", f"is not inside {outer_key!r} (a range of fewer outliers)")
        if not ranges:
            continue
        _, whole_key, whole = ranges[0]
        for kind, p, key, t in items:
            if kind == "matrix" and (t[0] < whole[0].min() or t[1] > whole[1].max()):
                _fail(f"tensor {key!r}", f"lies outside the whole range of {whole_key!r}")
