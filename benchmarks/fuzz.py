"""Hostile input, systematically: mutated recipes (JSON and tensors), command-line options out of range, method
names with broken flags, and two processes saving one recipe at once.

    python benchmarks/fuzz.py [--out benchmarks/results/fuzz.json]

Every case must end in a clear error (a kvsqueeze error, or argparse's usage error, whose message names the
problem) or in a result equal to the unmutated one. It is counted as a `traceback` when any other exception
escapes, `silent` when it loads and gives other outputs than the unmutated recipe, a `hang` past its time
limit. A recipe case is resealed (both checksums recomputed, as a tool that edits recipes would) so that the
checks behind the checksums are what it meets; an unsealed variant of each edit meets the checksum. Mutations
leave a field's domain (type, shape, dtype, order, range, nesting of ranges, presence); a recipe resealed with
other values inside every domain is another recipe, which only the checksums (the unsealed variants) tell apart.
Runs on a tiny random LLaMA calibrated here (no download), in a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import multiprocessing
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine  # noqa: E402

from kvsqueeze.cli import main as cli_main  # noqa: E402
from kvsqueeze.methods import MethodError, build_quantizers, parse_method  # noqa: E402
from kvsqueeze.recipe import META_FILE, TENSORS_FILE, Recipe, RecipeError, meta_digest  # noqa: E402

LIMIT_S = 60  # a case running longer is a hang
METHODS = ("nuq3-1%", "nuq2", "nuq4-0.1%", "nuq3-1%:pm", "nuq@3:chan", "nuq@3")
JUNK = (None, [], {}, "x", -1, 0, 1e308, True, [1, "a"], {"a": 1})


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang()


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      initializer_range=0.1, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def tiny_recipe(model) -> Recipe:
    from kvsqueeze.calibrate.collect import collect
    from kvsqueeze.calibrate.fit import CalibrationConfig, fit_recipe
    from kvsqueeze.methods.budget import allocate, allocate_channels, budget_key

    ids = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(1))
    acts = collect(model, ids, sinks=1, progress=False)
    recipe = fit_recipe(model, acts, CalibrationConfig(samples=4, seqlen=128), "tiny-llama", "random", progress=False)
    recipe.meta["budgets"] = {budget_key(3.0, 1): allocate(recipe, 3.0).as_dict(),
                              budget_key(3.0, 1, unit="channel"): allocate_channels(recipe, 3.0).as_dict()}
    return recipe


def outputs(recipe: Recipe, x: torch.Tensor) -> list[torch.Tensor]:
    """What a recipe decides: every layer's quantized keys and values of `x` under each of METHODS."""
    out = []
    for name in METHODS:
        for layer in range(2):
            kq, vq = build_quantizers(parse_method(name), recipe, layer, 32, 16)
            out += [kq.fake(x)[0], vq.fake(x)[0]]
    return out


def _paths(obj, prefix=()):
    """Every path into a JSON object (dict keys and list indices), depth first, lists sampled at their ends."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list) and obj:
        for i in sorted({0, len(obj) - 1}):
            yield from _paths(obj[i], (*prefix, i))


def _get(obj, path):
    for p in path:
        obj = obj[p]
    return obj


def _set(obj, path, value, delete=False):
    parent = _get(obj, path[:-1])
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value


def json_mutations(meta: dict):
    """(label, mutated meta) for each path: deleted, set to each junk value, numbers pushed out of range; a few
    fields swapped; an extra key."""
    skip = ("kmeans_objective",)  # thousands of leaves alike: their container and one entry are mutated
    for path in _paths(meta):
        if not path or path[0] in ("meta_sha256", "tensors_sha256") or (len(path) > 2 and path[0] in skip):
            continue
        where = ".".join(map(str, path))
        m = copy.deepcopy(meta)
        _set(m, path, None, delete=True)
        yield f"json {where}: deleted", m
        value = _get(meta, path)
        for junk in JUNK:
            if junk == value:
                continue
            m = copy.deepcopy(meta)
            _set(m, path, junk)
            yield f"json {where} = {json.dumps(junk)}", m
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            for v in (-value - 1, value * 1000 + 7):
                m = copy.deepcopy(meta)
                _set(m, path, v)
                yield f"json {where} = {v}", m
    for a, b in ((("settings", "bits"), ("settings", "fractions")), (("model", "id"), ("text",)),
                 (("model", "fingerprint", "kv_heads"), ("model", "fingerprint", "head_dim"))):
        m = copy.deepcopy(meta)
        va, vb = _get(m, a), _get(m, b)
        _set(m, a, vb)
        _set(m, b, va)
        yield f"json swap {'.'.join(a)} <-> {'.'.join(b)}", m
    m = copy.deepcopy(meta)
    m["unexpected"] = {"a": 1}
    yield "json extra key", m


def tensor_mutations(tensors: dict):
    kinds = {}
    for k in sorted(tensors, key=lambda k: (".p0" in k and ".p0." not in k, k)):  # ranges of 1% before whole ones
        kind = k.split(".")[2] if ".codebook." not in k else "codebook"
        kind = "chanerr" if ".chanerr." in k else kind
        kinds.setdefault(kind + (".range" if ".range." in k else ".matrix" if ".matrix." in k else ""), k)
    for key in kinds.values():
        t = tensors[key]
        edits = {
            "NaN": lambda t: t.clone().fill_(float("nan")),
            "Inf": lambda t: t.clone().fill_(float("inf")),
            "zeros": torch.zeros_like,
            "constant": lambda t: torch.full_like(t, 0.5),
            "flipped": lambda t: t.flip(0),
            "x1e6": lambda t: t * 1e6,  # leaves the domain of codebooks and of ranges finer than the whole one
            "negated": lambda t: -t,
            "truncated": lambda t: t[..., : max(1, t.shape[-1] // 2)],
            "transposed": lambda t: t.t() if t.ndim == 2 else t.unsqueeze(0),
            "float16": lambda t: t.half(),
            "int32": lambda t: t.int(),
        }
        for label, edit in edits.items():
            m = dict(tensors)
            m[key] = edit(t).contiguous()
            yield f"tensor {key}: {label}", m
        m = dict(tensors)
        del m[key]
        yield f"tensor {key}: deleted", m
    m = dict(tensors)
    m["layers.0.extra.range.p0"] = torch.zeros(2, 32)
    yield "tensor extra key", m


def write(d: Path, meta: dict, tensors: dict | None, reseal: bool) -> None:
    import hashlib

    from safetensors.torch import save_file

    if tensors is not None:
        save_file(tensors, str(d / TENSORS_FILE))
    meta = copy.deepcopy(meta)
    if reseal:
        meta["tensors_sha256"] = hashlib.sha256((d / TENSORS_FILE).read_bytes()).hexdigest()
        meta["meta_sha256"] = meta_digest(meta)
    (d / META_FILE).write_text(json.dumps(meta))


def run_case(fn) -> tuple[str, str]:
    """('clear' | 'same' | 'silent' | 'traceback' | 'hang', detail)."""
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(LIMIT_S)
    try:
        return fn()
    except Hang:
        return "hang", f"over {LIMIT_S}s"
    except (RecipeError, MethodError) as exc:
        return "clear", str(exc)[:200]
    except Exception as exc:  # anything else escaping is a traceback a user would see
        return "traceback", f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        signal.alarm(0)


def recipe_cases(base: Path, baseline: list[torch.Tensor], x: torch.Tensor):
    meta = json.loads((base / META_FILE).read_text())
    from safetensors.torch import load_file

    tensors = load_file(str(base / TENSORS_FILE))
    work = base.parent / "case"

    def check(meta_m, tensors_m, reseal):
        def fn():
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(base, work)
            try:
                write(work, meta_m, tensors_m, reseal)
            except (TypeError, ValueError) as exc:  # cannot be written as a recipe at all (e.g. a shared tensor)
                return "clear", f"not writable: {exc}"[:200]
            got = outputs(Recipe.load(work), x)
            same = len(got) == len(baseline) and all(torch.equal(a, b) for a, b in zip(got, baseline))
            return ("same", "") if same else ("silent", "loaded and quantizes otherwise")
        return fn

    for label, m in json_mutations(meta):
        yield label + " (resealed)", check(m, None, True)
        yield label + " (checksums as they were)", check(m, None, False)
    for label, t in tensor_mutations(tensors):
        yield label + " (resealed)", check(meta, t, True)
        yield label + " (checksums as they were)", check(meta, t, False)


def cli_cases(tmp: Path):
    numeric = {
        "calibrate": ["--samples", "--seqlen", "--sinks", "--outliers", "--bits", "--avg-bits", "--kl-windows",
                      "--kl-seqlen", "--kl-outliers", "--kl-bits"],
        "eval": ["--seqlen", "--max-windows", "--methods"],
        "budget": ["--windows", "--seqlen", "--bits", "--outliers", "--sinks", "--avg-bits"],
        "ruler": ["--lengths", "--samples", "--chunk", "--methods", "--tasks"],
        "passkey": ["--lengths", "--trials", "--methods"],
        "memory": ["--context", "--batch", "--gpus", "--gpu-mem", "--methods"],
        "generate": ["--max-new-tokens", "--method"],
    }
    values = ["-1", "0", "abc", "", "nan", "1e9", "99999999999999999999", "3,,x", "-5%"]
    required = {"calibrate": ["--out", str(tmp / "out")], "budget": ["--recipe", str(tmp / "none")],
                "generate": ["--prompt", "hi"]}
    for cmd, opts in numeric.items():
        for opt in opts:
            for v in values:
                argv = [cmd, "--model", str(tmp / "no-such-model"), *required.get(cmd, []), opt, v]
                if cmd == "memory":
                    argv = [cmd, *required.get(cmd, []), opt, v]

                def fn(argv=argv):
                    err = io.StringIO()
                    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                        try:
                            rc = cli_main(argv)
                        except SystemExit as exc:
                            rc = exc.code
                    text = err.getvalue().strip()
                    if rc == 2 and text and "Traceback" not in text:
                        return "clear", text.splitlines()[-1][:200]
                    if rc == 0 and cmd == "memory":
                        return "same", "a valid option value"
                    return "traceback", f"rc {rc}: {text[-200:]}"
                yield f"cli {cmd} {opt} {v!r}", fn


def name_cases():
    flags = [":r", ":kslots", ":sink", ":ctx", ":g", "@", "-", ":k", ":v"]
    numbers = ["", "-1", "0", "1e9", "99999999999999999999", "x", "3.5.5", "%"]
    for base in ("nuq3-1%", "nuq@3.5:chan", "kivi2", "turbo3", "int4", "fp16"):
        for f in flags:
            for n in numbers:
                name = base + f + n

                def fn(name=name):
                    spec = parse_method(name)
                    from kvsqueeze.methods import average_bits
                    if spec.budget is None:
                        average_bits(spec, 2, 32, 16, 2048)
                    return "same", f"parses as {spec.name}"
                yield f"method {name!r}", fn


def _save_many(args):
    src, d, tag, rounds = args
    recipe = Recipe.load(src)
    recipe.meta["text"] = tag
    key = "layers.0.codebook.v.b2.p0.vector.fs2"
    recipe.tensors[key] = recipe.tensors[key] * (0.5 if tag == "b" else 1.0)  # another valid codebook
    for _ in range(rounds):
        recipe.save(d)


def concurrency_cases(base: Path, rounds: int = 10):
    """Two processes saving different recipes into one directory while this one loads it: each load is one
    whole recipe (its text and its tensors agree) or a clear error."""
    d = base.parent / "shared"
    shutil.copytree(base, d)
    key = "layers.0.codebook.v.b2.p0.vector.fs2"
    ref = Recipe.load(base).tensors[key]
    ctx = multiprocessing.get_context("spawn")
    results = []
    with ctx.Pool(2) as pool:
        pending = pool.map_async(_save_many, [(base, d, "a", rounds), (base, d, "b", rounds)])
        while not pending.ready() or not results:
            def fn():
                r = Recipe.load(d)
                whole = torch.equal(r.tensors[key], ref * (0.5 if r.meta["text"] == "b" else 1.0))
                return ("same", "one whole recipe") if whole else ("silent", "a JSON with the other's tensors")
            results.append(("concurrent load", run_case(fn)))
        pending.get()
    return results


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "fuzz.json"))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    model = tiny_model()
    recipe = tiny_recipe(model)
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(2)) * 2
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = recipe.save(tmp / "recipe")
        baseline = outputs(Recipe.load(base), x)
        for source in (recipe_cases(base, baseline, x), cli_cases(tmp), name_cases()):
            for label, fn in source:
                cases.append((label, run_case(fn)))
        cases += concurrency_cases(base)
    rows = [{"case": label, "outcome": outcome, "detail": detail[:120]} for label, (outcome, detail) in cases]
    summary = {"cases": len(rows)}
    for k in ("clear", "same", "silent", "traceback", "hang"):
        summary[k if k != "traceback" else "tracebacks"] = sum(r["outcome"] == k for r in rows)
    summary["hangs"] = summary.pop("hang")
    payload = {"summary": summary, "seconds": round(time.perf_counter() - t0, 1), "machine": machine(),
               "protocol": __doc__.strip().split("\n\n")[2], "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    head = json.dumps({k: v for k, v in payload.items() if k != "rows"}, indent=1)[:-2]
    body = ",\n".join("  " + json.dumps(r, ensure_ascii=False) for r in rows)
    Path(args.out).write_text(f'{head},\n "rows": [\n{body}\n ]\n}}\n')  # one case per line
    print(json.dumps(summary))
    for r in rows:
        if r["outcome"] in ("silent", "traceback", "hang"):
            print(f"  {r['outcome']:>9}  {r['case']}: {r['detail']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
