"""A bounded load test of vLLM's OpenAI server with the kvsqueeze backend, on loopback only.

    python benchmarks/vllm_load.py [--model smollm2-135m] [--recipe out/recipe]
        [--method q3.5] [--requests 200] [--clients 24] [--cancel 0.1] [--shared 0.3]
        [--kv-mib 64] [--max-model-len 1024] [--subset 8] [--json benchmarks/results/vllm.json]

One server (`--kv-mib` of KV space: a few thousand tokens of pages, far fewer than the clients ask for at once, so
that vLLM's scheduler must preempt), then `--requests` completion requests from `--clients` threads:

* prompts of 16 to `--max-model-len` - 80 tokens cut from the BBC evaluation text, a share `--shared` of them
  starting with one 256-token prefix (prefix caching shares its pages);
* greedy, 8 to 64 new tokens each;
* a share `--cancel` streamed and dropped after their second chunk (the server must abort them and free their
  pages);
* every other request must answer 200 with as many tokens as asked.

Then: the share of KV pages in use, read from the server's metrics once it is idle again (after one short probe
request, which brings the gauge up to date), must equal what it was idle before the load (`pages_freed`: every
page of every finished, cancelled or preempted request back in vLLM's pool, which also holds the fp16 window's
pages; pages kept only for prefix hits count as free); the prefix cache is then emptied (vLLM's development
endpoint, on loopback) and `--subset` fixed requests are sent again one at a time to the idle server, so they are
computed afresh, not read from pages written under load, and their tokens must equal what they got under load
(`subset_equal`). Preemptions are vLLM's own counter (`vllm:num_preemptions`).

The result goes into `--json` under `load_test` (the file's other measurements are kept). The run ends by itself:
every request has a timeout, and the server is stopped on the way out.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import re
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, openai_server, serving_arguments, serving_setup, write_section  # noqa: E402

TIMEOUT = 900  # seconds a request may take (queued behind the others included)


def _post(port: int, body: dict, stream: bool = False):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=TIMEOUT)


def complete(port: int, prompt: list[int], new: int) -> list[int]:
    """Greedy completion of token ids; the generated token ids."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": new, "min_tokens": new, "temperature": 0,
            "return_token_ids": True, "ignore_eos": True}
    with _post(port, body) as resp:
        answer = json.loads(resp.read())
    return list(answer["choices"][0]["token_ids"])


def cancel(port: int, prompt: list[int], new: int) -> int:
    """Stream a completion and drop the connection after its second chunk; the chunks read."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": new, "min_tokens": new, "temperature": 0,
            "stream": True, "ignore_eos": True}
    chunks = 0
    with _post(port, body, stream=True) as resp:
        for line in resp:
            if line.startswith(b"data:") and b"[DONE]" not in line:
                chunks += 1
                if chunks == 2:
                    break
    return chunks


def top_logprobs(port: int, prompt: list[int]) -> dict[int, float]:
    """The five most likely next tokens after `prompt` and their log-probabilities (one greedy step)."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 5,
            "return_tokens_as_token_ids": True}
    with _post(port, body) as resp:
        answer = json.loads(resp.read())
    top = answer["choices"][0]["logprobs"]["top_logprobs"][0]
    return {int(k.split(":")[-1]): v for k, v in top.items()}


def metric(port: int, name: str) -> float:
    """A metric of the server's Prometheus endpoint, summed over its label sets."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    values = [float(m[1]) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    if not values:
        raise SystemExit(f"the server exports no metric {name}")
    return sum(values)


def reset_prefix_cache(port: int) -> None:
    """Empty the server's prefix cache (a development endpoint: the server runs with VLLM_SERVER_DEV_MODE=1)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/reset_prefix_cache", method="POST")
    try:
        urllib.request.urlopen(request, timeout=120).read()
    except urllib.error.URLError as exc:
        raise SystemExit(f"the server did not empty its prefix cache ({exc}): subset_equal would compare pages "
                         "written under load with themselves") from exc


def probe_usage(port: int, prompt: list[int]) -> float:
    """KV pages in use (share of all) on the idle server, read after one short request has finished: the gauge is
    set as the scheduler runs, so the probe makes it current."""
    complete(port, prompt, 4)
    return metric(port, "vllm:kv_cache_usage_perc")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serving_arguments(ap)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=24)
    ap.add_argument("--cancel", type=float, default=0.1)
    ap.add_argument("--shared", type=float, default=0.3)
    # 64: the default method's window reserves pages for a whole prompt in flight (24 MiB cannot admit 940 tokens)
    ap.add_argument("--kv-mib", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--subset", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from kvsqueeze.eval.texts import load_text
    from kvsqueeze.integrations.loading import load_model, resolve_model_path

    py, recipe, served = serving_setup(args)
    _, tok = load_model(args.model, "float32")
    ids = tok(load_text("bbc").evaluation, add_special_tokens=False).input_ids
    rng = random.Random(args.seed)
    prefix = ids[:256]
    longest = args.max_model_len - 80
    plan = []
    for i in range(args.requests):
        n = rng.randint(16, longest)
        start = rng.randrange(1000, len(ids) - n)
        prompt = ids[start:start + n]
        if rng.random() < args.shared and n > 300:
            prompt = prefix + prompt[256:]
        plan.append({"prompt": prompt, "new": rng.randint(8, 64), "cancel": rng.random() < args.cancel})
    subset = [i for i, p in enumerate(plan) if not p["cancel"]][:: max(1, args.requests // max(1, args.subset))]
    subset = subset[:args.subset]

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmpdir, openai_server(
            py, resolve_model_path(args.model), recipe, served, Path(tmpdir) / "serve.log", "--max-model-len",
            str(args.max_model_len), "--kv-cache-memory-bytes", str(args.kv_mib << 20), dev=True) as (port, boot):
        probe = ids[500:540]
        before = probe_usage(port, probe)
        preempt_before = metric(port, "vllm:num_preemptions_total")

        def one(i: int) -> dict:
            p = plan[i]
            t0 = time.perf_counter()
            try:
                if p["cancel"]:
                    return {"i": i, "cancelled": True, "chunks": cancel(port, p["prompt"], p["new"]),
                            "seconds": time.perf_counter() - t0}
                got = complete(port, p["prompt"], p["new"])
                ok = len(got) == p["new"]
                return {"i": i, "tokens": got, "error": None if ok else f"{len(got)} tokens for {p['new']}",
                        "seconds": time.perf_counter() - t0}
            except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
                return {"i": i, "error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - t0}

        t_load = time.perf_counter()
        peak = [0.0]
        with cf.ThreadPoolExecutor(args.clients + 1) as pool:
            jobs = [pool.submit(one, i) for i in range(len(plan))]
            while not all(j.done() for j in jobs):  # the usage gauge while the load runs: it does move
                peak[0] = max(peak[0], metric(port, "vllm:kv_cache_usage_perc"))
                time.sleep(1)
            done = [j.result() for j in jobs]
        load_seconds = time.perf_counter() - t_load
        time.sleep(2)  # aborts of dropped streams reach the engine
        after = probe_usage(port, probe)
        preemptions = metric(port, "vllm:num_preemptions_total") - preempt_before
        reset_prefix_cache(port)  # the subset is computed again, not read back from pages written under load
        alone = {i: complete(port, plan[i]["prompt"], plan[i]["new"]) for i in subset}
        # where a token differs, how close the two choices were, given the same prefix, on the idle server: a gap
        # of float rounding means batched arithmetic broke a near-tie, a large one a cache that held other data
        differences = []
        for i in subset:
            a, b = alone[i], done[i].get("tokens") or []
            j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if j is not None:
                top = top_logprobs(port, plan[i]["prompt"] + a[:j])
                gap = top[a[j]] - top[b[j]] if b[j] in top else None
                differences.append({"request": i, "position": j, "of": len(a), "alone": a[j], "under_load": b[j],
                                    "logprob_gap": None if gap is None else round(gap, 5)})
        stats_log = (Path(tmpdir) / "serve.log").read_text()
    errors = [d for d in done if d.get("error")]
    equal = [alone[i] == done[i].get("tokens") for i in subset]
    kv_tokens = re.findall(r"KV cache size: ([\d,]+) tokens", stats_log)  # "CPU KV cache size" on this engine
    result = {
        "machine": machine(), "model": args.model, "recipe": args.recipe, "method": args.method,
        "served_method": served, "requests": len(plan), "clients": args.clients,
        "errors": len(errors), "error_examples": [e["error"] for e in errors[:5]],
        "cancelled": sum(p["cancel"] for p in plan),
        "cancelled_after_chunks": sorted({d.get("chunks") for d in done if d.get("cancelled")}),
        "shared_prefix_requests": sum(p["prompt"][:256] == prefix for p in plan),
        "prompt_tokens": {"min": min(len(p["prompt"]) for p in plan), "max": max(len(p["prompt"]) for p in plan),
                          "sum": sum(len(p["prompt"]) for p in plan)},
        "new_tokens": sum(p["new"] for p in plan if not p["cancel"]),
        "kv_space_bytes": args.kv_mib << 20, "kv_tokens": int(kv_tokens[-1].replace(",", "")) if kv_tokens else None,
        "max_model_len": args.max_model_len, "preemptions": int(preemptions),
        "kv_usage_with_probe_before": before, "kv_usage_with_probe_after": after, "pages_freed": before == after,
        "kv_usage_peak_during_load": peak[0],
        "subset": len(subset), "subset_equal_count": sum(equal), "subset_equal": all(equal),
        "subset_differences": differences,
        "load_seconds": round(load_seconds, 1), "server_start_seconds": round(boot, 1),
        "seconds": round(time.perf_counter() - started, 1),
        "how": "requests from client threads at once against one server on 127.0.0.1; cancelled: streamed and "
               "dropped after the second chunk; pages_freed: the KV usage gauge of the idle server (after one "
               "short probe request) before and after the load; subset_equal: those requests' greedy tokens sent "
               "again one at a time to the idle server, its prefix cache emptied first; subset_differences: each one's first differing token and the gap between the two "
               "choices' log-probabilities given the same prefix on the idle server",
    }
    write_section(args.json, "load_test", result)
    return 0 if not errors and result["pages_freed"] else 1


if __name__ == "__main__":
    sys.exit(main())
