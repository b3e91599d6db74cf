"""The pages a serving engine holds against the HF path's store, given the same keys and values.

The vLLM backend builds each layer's pages with `ServingConfig.layout` (the served method, its key slots resolved)
and writes into them the pre-RoPE keys and values of every new token; kvsqueeze's own cache (`cache_for`, what
`generate` fills) stores the same method. Fed the keys and values of one forward, the two hold the same codes
bit for bit and reconstruct the same floats, in every layer, for plain methods and for bit budgets whose layers
have their own widths, outliers and page sizes. These run without vLLM; `make vllm-test` runs the engine itself.
"""

from __future__ import annotations

import pytest
import torch

from kvsqueeze.integrations.cache import cache_for
from kvsqueeze.kernels.reference import dequantize_view
from kvsqueeze.serving.settings import ServingConfig, ServingError

from test_budget import _mixed


def _captured(model, ids, cache):
    """Each layer's pre-RoPE keys and values [T, C] (the k_proj / v_proj outputs of a LLaMA) of one forward that
    fills `cache` (its prefill attends the quantized cache, so each layer's inputs are the cache's own)."""
    got, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        for name in ("k_proj", "v_proj"):
            hooks.append(getattr(layer.self_attn, name).register_forward_hook(
                lambda mod, inp, out, key=(i, name): got.__setitem__(key, out[0].detach().float())))
    try:
        with torch.no_grad():
            model(ids, cache=cache, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    return [(got[(i, "k_proj")], got[(i, "v_proj")]) for i in range(len(model.model.layers))]


@pytest.mark.parametrize("method, budget", [("nuq3-1%", None), ("nuq@3:chan", 3.0), ("nuq@3.5", None)])
def test_pages_hold_the_codes_the_hf_store_holds(tiny_llama, tiny_recipe, tmp_path, method, budget):
    recipe = _mixed(tiny_recipe, budget) if budget else tiny_recipe
    recipe_dir = recipe.save(tmp_path / "recipe")
    config = ServingConfig(str(recipe_dir), method)
    spec = config.spec
    from kvsqueeze.methods import build_quantizers

    keeps = [build_quantizers(spec, recipe, i, 32)[0].fraction > 0 for i in range(2)]
    assert (spec.key_slots > 0) == any(keeps)  # resolved: pages hold a fixed count of exact key elements a token
    ids = torch.randint(0, 256, (1, 45), generator=torch.Generator().manual_seed(3))
    cache = cache_for(tiny_llama, recipe_dir, spec)
    kv = _captured(tiny_llama, ids, cache)
    c, d, bs, n = kv[0][0].shape[1], tiny_llama.config.head_dim, 8, ids.shape[1]
    sizes = set()
    for i, (k, v) in enumerate(kv):
        layout = config.layout(i, c, d, bs)
        sizes.add(layout.page_bytes)
        need = -(-n // bs)
        pages = layout.allocate(need + 2).random_(0, 256)  # garbage where no token is written
        table = torch.randperm(need + 2, generator=torch.Generator().manual_seed(i))[:need].to(torch.int32)
        pos = torch.arange(n)
        slots = table[pos // bs].long() * bs + pos % bs
        for chunk in pos.split(16):  # a prefill chunk at a time, then single decode tokens
            layout.write(pages, slots[chunk], k[chunk], v[chunk], pos[chunk])
        view, _ = layout.view(pages, table.view(1, -1), torch.tensor([n]))
        store = cache.layers[i].store.view().trim()
        for name in ("k_codes", "v_codes"):  # the packed codes, every word (a sink's codes are no code: skipped)
            a, b = getattr(view, name)[spec.sinks:n, 0], getattr(store, name)[spec.sinks:n, 0]
            assert a.shape == b.shape and torch.equal(a, b), (i, name)
        assert torch.equal(view.v_scale_zero[spec.sinks:n, 0].view(torch.int16),
                           store.v_scale_zero[spec.sinks:n, 0].view(torch.int16))
        pk, pv = dequantize_view(view)
        sk, sv = cache.layers[i].store.dequantize()
        assert torch.equal(pk[:n, 0], sk[:, 0]) and torch.equal(pv[:n, 0], sv[:, 0]), i
        assert torch.equal(layout.read(pages, table, n)[0], sk[:, 0])
    if budget:  # the budget gives its layers different widths: pages of different sizes
        assert len(sizes) > 1


def test_methods_pages_cannot_hold_are_refused_with_the_fix(tiny_recipe_dir):
    with pytest.raises(ServingError, match="per-vector"):
        _ = ServingConfig(str(tiny_recipe_dir), "nuq3-1%:pm").spec


@pytest.mark.parametrize("method, budget", [("nuq3-1%", None), ("nuq@3:chan", 3.0)])
def test_a_page_holds_the_registry_s_bytes_per_token(tiny_recipe, tmp_path, method, budget):
    """Each layer's page holds, per token, exactly the bytes the registry counts for one more token of the HF
    store (whose key outliers, a fixed count per token as in pages, need no pointers either); the rest of a page
    is its sink area and the alignment of its regions (under 16 bytes each)."""
    from kvsqueeze.methods import family
    from kvsqueeze.storage import Rows, total

    recipe = _mixed(tiny_recipe, budget) if budget else tiny_recipe
    config = ServingConfig(str(recipe.save(tmp_path / "recipe")), method)
    spec, bs, c, d = config.spec, 16, 32, 16
    for layer in range(2):
        layout = config.layout(layer, c, d, bs)
        a, b = (family(spec).layer_bytes(spec, recipe, layer, c, d, Rows(n)) for n in (500, 501))
        assert spec.key_slots and b["pointers"] == a["pointers"] == 0
        per_token = total(b) - total(a)
        data = sum(r.nbytes for name, r in layout.regions.items() if not name.startswith("sink"))
        assert data == bs * per_token
        sink_area = sum(r.nbytes for name, r in layout.regions.items() if name.startswith("sink"))
        assert sink_area == 2 * 2 * spec.sinks * c
        assert 0 <= layout.page_bytes - data - sink_area < 16 * len(layout.regions)


@pytest.mark.parametrize("method, budget", [("nuq3-1%", None), ("nuq@3:chan", 3.0)])
def test_each_rank_holds_its_heads_of_what_one_rank_holds(tiny_llama, tiny_recipe, tmp_path, method, budget):
    """Tensor parallelism: given the keys and values of one forward (every head's, as the ranks exchange them),
    rank r's pages of every layer reconstruct exactly head r's channels of one rank's pages, in pages of one size
    on both ranks (the larger share's) and smaller than one rank's."""
    recipe = _mixed(tiny_recipe, budget) if budget else tiny_recipe
    config = ServingConfig(str(recipe.save(tmp_path / "recipe")), method)
    ids = torch.randint(0, 256, (1, 45), generator=torch.Generator().manual_seed(4))
    kv = _captured(tiny_llama, ids, cache_for(tiny_llama, tmp_path / "recipe", config.spec))
    c, d, bs, n = kv[0][0].shape[1], tiny_llama.config.head_dim, 8, ids.shape[1]
    table, pos = torch.arange(-(-n // bs), dtype=torch.int32), torch.arange(n)
    for i, (k, v) in enumerate(kv):
        one = config.layout(i, c, d, bs)
        shares = [config.layout(i, c, d, bs, rank, 2) for rank in range(2)]
        assert shares[0].page_bytes == shares[1].page_bytes < one.page_bytes
        whole = None
        for layout in (one, *shares):
            pages = layout.allocate(len(table)).random_(0, 256)
            for chunk in pos.split(16):
                layout.write(pages, chunk, k[chunk], v[chunk], chunk)
            got = layout.read(pages, table, n)
            if whole is None:
                whole = got
                continue
            cut = slice(layout.first_channel, layout.first_channel + layout.channels)
            assert torch.equal(got[0], whole[0][:, cut]) and torch.equal(got[1], whole[1][:, cut]), (i, cut)


_PARALLEL_KERNEL = ("import numpy as np\n"
                    "from numba import njit, prange\n"
                    "@njit(parallel=True)\n"
                    "def f(a):\n"
                    "    for i in prange(a.shape[0]):\n"
                    "        a[i] += 1.0\n"
                    "f(np.zeros(64))\n")


def _engine_numba(python: str, preset: str | None) -> list[str]:
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    if preset:
        env["NUMBA_THREADING_LAYER"] = preset
    code = ("import os, sys\n"
            "from kvsqueeze.serving.settings import numba_for_engine\n"
            "numba_for_engine()\n"
            "import numba\n" + _PARALLEL_KERNEL +
            "print(numba.threading_layer(), os.environ['NUMBA_CACHE_DIR'].startswith(sys.prefix))\n")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_an_engine_process_runs_numba_off_openmp_unless_told_otherwise():
    """vLLM pins a numba whose OpenMP runtime, beside torch's, slows torch's calls in the engine several times:
    an engine's process runs numba's kernels on TBB where vLLM's environment has it (`make vllm-setup`), else on
    workqueue, with a cache of its own; a user's own choice of layer is kept."""
    import os
    import sys

    assert _engine_numba(sys.executable, None) == ["workqueue", "True"]  # kvsqueeze's environment has no TBB
    assert _engine_numba(sys.executable, "omp") == ["omp", "True"]
    from tests.serving.vllm_env import VLLM_PYTHON

    if VLLM_PYTHON.exists():  # `make vllm-setup`'s environment (skipped by `make test` without it)
        assert _engine_numba(str(VLLM_PYTHON), None) == ["tbb", "True"]


def test_numba_settings_come_too_late_once_numba_is_loaded():
    """Numba reads its settings when first imported: after that the engine's settings leave the environment as
    it is rather than pretending to apply."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    code = ("import os, numba\n"
            "from kvsqueeze.serving.settings import numba_for_engine\n"
            "numba_for_engine()\n"
            "print(os.environ.get('NUMBA_THREADING_LAYER', 'unset'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["unset"]


def test_window_pages_take_no_more_tokens_than_fit_in_a_block_of_codes():
    """vLLM makes every block of the pool the larger of a block of the layers' pages and a window page; the
    default model's 3.5-bit budget at 16-token blocks (92,480 bytes a block, 23,040 a window entry) would have had
    every block padded to a 16-token window page, as large as a bf16 cache's. The window page shrinks instead (a
    power of two dividing the block size, at most 16) and stays 16 tokens where it fits."""
    from kvsqueeze.serving.settings import window_page_tokens

    entry = 30 * 2 * 192 * 2
    assert window_page_tokens(16, 92_480, entry) == 4
    assert window_page_tokens(32, 161_920, entry) == 4
    assert window_page_tokens(64, 300_800, entry) == 8
    assert window_page_tokens(128, 578_560, entry) == 16
    assert window_page_tokens(128) == 16 and window_page_tokens(24) == 8  # unsized: a divisor of the block
    assert window_page_tokens(16, 10_000, entry) == 1  # nothing fits: one token, which the engine warns about
