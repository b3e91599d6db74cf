"""What a method stores is counted once (`kvsqueeze.storage`, read through the method registry) and equals, byte
for byte, what the compressed cache holds.

For every method of the ladder the compressed cache can hold, on a tiny LLaMA, Qwen3 (k_norm) and Gemma-3 (k_norm,
head_dim 256, a sliding layer beside a full one), at 100, 2,048 and 20,000 tokens, for one row and for a
left-padded batch of two, the cache is filled through its layers' own append (as a prefill does) with keys and
values that have outliers, and its `MemoryReport` components are compared with the registry's `cache_bytes` given
the outlier counts the store kept. The counts are then shown to have the power to catch a miscount: dropping the
code words' padding, or the decode tables, makes them disagree.
"""

from __future__ import annotations

import pytest
import torch

import kvsqueeze
from conftest import HEAD_DIM, HIDDEN, INIT_STD, KV_HEADS, VOCAB, random_ids
from kvsqueeze import storage
from kvsqueeze.methods.budget import allocate_channels, spec_allocation
from kvsqueeze.calibrate.collect import collect
from kvsqueeze.calibrate.fit import CalibrationConfig, fit_recipe
from kvsqueeze.methods import MethodError, cache_bytes, check_path, family, parse_method
from kvsqueeze.storage import Rows

CACHED = ["fp16", "nuq3-1%", "nuq2-1%", "nuq4-1%", "nuq3", "nuq3-1%:kslots6", "nuq3-1%:pm", "nf3-1%:kchan:pre",
          "int4:kchan:pre:sink2", "nuq3-1%:r16", "nuq@3.5", "nuq@3.49:r32:chan", "nuq@2.6:r32:chan",
          "nuq@4.58:r32:chan", "nuq@3.5:chan:ctx32k"]
MODELLED = ["kivi2", "turbo3:split", "int3", "group3:g64"]  # no compressed cache holds them
CAL = CalibrationConfig(samples=2, seqlen=64, bits=(2, 3, 4), fractions=(0.0, 0.01),
                        ablation=True)  # the per-matrix (":pm") rows too


def _model(arch: str):
    import transformers
    from transformers import AutoModelForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                  num_attention_heads=HIDDEN // HEAD_DIM, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                  max_position_embeddings=1 << 15, initializer_range=INIT_STD, tie_word_embeddings=False,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if arch == "gemma3":
        common.update(head_dim=256, query_pre_attn_scalar=256, sliding_window=8, num_key_value_heads=1,
                      layer_types=["sliding_attention", "full_attention"])
    cfg = getattr(transformers, {"llama": "LlamaConfig", "qwen3": "Qwen3Config",
                                 "gemma3": "Gemma3TextConfig"}[arch])(**common)
    torch.manual_seed(7)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3"])
def calibrated(request):
    model = _model(request.param)
    acts = collect(model, random_ids(CAL.samples, CAL.seqlen, seed=5), sinks=1, progress=False)
    return request.param, model, fit_recipe(model, acts, CAL, f"tiny-{request.param}", "random", progress=False)


def _fill(cache, tokens: int, padding: tuple[int, ...], seed: int) -> None:
    """Keys and values with heavy-tailed channels appended to every layer as a prefill would, then each sliding
    layer trimmed to its window as after a forward."""
    g = torch.Generator().manual_seed(seed)
    b = len(padding)
    real = torch.arange(tokens).view(1, -1) >= torch.tensor(padding).view(-1, 1)  # [B, T], left padding
    positions = (real.long().cumsum(1) - 1).clamp(min=0)
    for layer in cache.layers:
        c = layer.store.channels
        k = torch.randn(b, tokens, c, generator=g) * (1 + 3 * torch.rand(c, generator=g))
        v = torch.randn(b, tokens, c, generator=g)
        k[torch.rand(b, tokens, c, generator=g) < 0.003] *= 8  # outliers past the calibrated ranges
        layer.append_pre_rope(k, v, positions, real)
        layer.slide()


def _held(cache) -> tuple[list, list]:
    """Per layer, what the registry needs of a filled cache: the slots a sliding layer keeps (None: a full one)
    and the (key, value) outliers its store holds."""
    held, outliers = [], []
    for layer in cache.layers:
        s = layer.store
        held.append(None if layer.window is None else layer.kept_tokens())
        n_sinks = int(s.sink_count.sum())
        k = s.k_outliers.nnz if s.k_outliers is not None else 0
        v = (s.v_outliers.nnz - n_sinks * (s.v_fixed or 0)) if s.v_outliers is not None else 0
        outliers.append((k, v))
    return held, outliers


@pytest.mark.parametrize("tokens", [100, 2048, 20_000])
@pytest.mark.parametrize("padding", [(0,), (0, 37)], ids=["batch1", "padded2"])
def test_the_memory_report_equals_the_registry_byte_for_byte(calibrated, tokens, padding):
    arch, model, recipe = calibrated
    from kvsqueeze.shape import kv_shape

    shape = kv_shape(model.config)
    for i, name in enumerate(CACHED):
        spec = parse_method(name)
        with kvsqueeze.cache_for(model, recipe, spec) as cache:
            if spec.quantized:
                _fill(cache, tokens, padding, seed=i)
                held, outliers = _held(cache)
            else:  # the fp16 cache is filled by a forward of its own
                ids = random_ids(len(padding), 40, seed=i)
                with torch.no_grad():
                    model(ids, cache=cache, use_cache=True)
                tokens_here = 40
                held = [None if layer.window is None else layer.kept_tokens() for layer in cache.layers]
                outliers = None
            report = cache.memory_report()
            rows = Rows(tokens if spec.quantized else tokens_here, padding)
            want = cache_bytes(spec, shape.layers, shape.channels, shape.head_dim, rows, recipe, held, outliers)
            assert report.components == want, f"{arch} {name} at {tokens} tokens, padding {padding}"
            assert report.total_bytes == storage.total(want)


def test_the_counts_catch_a_miscount(calibrated, monkeypatch):
    """The comparison above has power: a count that drops the decode tables of a method with a width per channel,
    or the sink slots, disagrees with the bytes held. (A budget spends its last word's spare bits on upgrades, so
    its units fill whole words; the padding rule is held to the store's packing in the test after this one.)"""
    arch, model, recipe = calibrated
    from kvsqueeze.shape import kv_shape

    shape = kv_shape(model.config)
    spec = parse_method("nuq@3.49:r32:chan:ctx32k")  # at 32K every model's budget gives channels widths
    alloc = spec_allocation(spec, recipe)
    per_channel = [c for c in (*alloc.keys, *alloc.values) if c.widths is not None]
    if arch == "llama":  # its channels differ enough that the budget gives them widths of their own
        assert per_channel, "the budget gave no unit widths of its own; the checks below would not test them"
    with kvsqueeze.cache_for(model, recipe, spec) as cache:
        _fill(cache, 100, (0,), seed=1)
        held, outliers = _held(cache)
        report = cache.memory_report().components
    rows = Rows(100)
    assert cache_bytes(spec, shape.layers, shape.channels, shape.head_dim, rows, recipe, held, outliers) == report
    real = storage.tensor_bytes
    for dropped in ("decode_tables", "sink_slots"):
        def without(*args, _name=dropped, **kw):
            out = real(*args, **kw)
            out[_name] = 0
            return out

        monkeypatch.setattr(storage, "tensor_bytes", without)
        counted = cache_bytes(spec, shape.layers, shape.channels, shape.head_dim, rows, recipe, held, outliers)
        assert (counted != report) == (dropped == "sink_slots" or bool(per_channel)), dropped
        monkeypatch.undo()


@pytest.mark.parametrize("channels,bits,widths,words", [
    (48, 3, None, 6),  # equal widths pack in groups of 32 codes: two groups of 3 words, the second half empty
    (64, 4, None, 8),
    (32, 6, tuple(1 + i % 6 for i in range(32)), 4),  # widths of their own back to back: 108 bits, 20 of padding
    (5, 2, (1, 2, 1, 2, 1), 1),
])
def test_a_slot_counts_the_padding_of_its_last_word(channels, bits, widths, words):
    """The registry's words per slot (`storage.slot_words`) are the words the store's packing writes, the last
    word's padding included."""
    from kvsqueeze.numerics.packing import code_offsets, pack_codes, pack_mixed

    g = torch.Generator().manual_seed(0)
    if widths is None:
        packed = pack_codes(torch.randint(0, 2**bits, (3, channels), generator=g), bits)
    else:
        w = torch.tensor(widths)
        packed = pack_mixed((torch.rand(3, channels, generator=g) * 2.0**w).long(), code_offsets(w))
    assert packed.shape[-1] == storage.slot_words(channels, storage.Choice(bits, 0.0, widths)) == words


@pytest.mark.parametrize("name", MODELLED)
def test_methods_without_a_compressed_cache_are_refused_and_counted_as_modelled(name):
    spec = parse_method(name)
    with pytest.raises(MethodError, match="quantize|stores|keys"):  # the reason, named
        check_path(spec, "cache")
    assert family(spec).source(spec) == "model"
    bytes_ = cache_bytes(spec, 2, 64, 32, Rows(1000))
    assert storage.total(bytes_) > 0


def test_a_budget_holds_its_bits_at_the_context_it_is_chosen_for(tiny_recipe):
    """The choice counts every byte the cache holds at its context: the average held there is at most the budget
    (and within one word per slot of it), and a choice made for 32K tokens holds its budget at 32K."""
    from kvsqueeze.methods import average_bits

    for name in ("nuq@3.49:r32:chan", "nuq@2.6:r32:chan", "nuq@4.58:r32:chan", "nuq@3.5", "nuq@3.5:chan:ctx32k",
                 "nuq@3.49:r32:chan:ctx128k"):
        spec = parse_method(name)
        t = spec.budget_context
        held = average_bits(spec, 2, 32, 16, t, tiny_recipe)
        assert held <= spec.budget + 1e-9, name
        assert held > spec.budget - 0.35, name  # the choice spends its budget (tiny layers: coarse steps)
        assert spec_allocation(spec, tiny_recipe).bits == pytest.approx(held, rel=1e-12), name
    short = average_bits(parse_method("nuq@3.49:r32:chan"), 2, 32, 16, 32768, tiny_recipe)
    long = average_bits(parse_method("nuq@3.49:r32:chan:ctx32k"), 2, 32, 16, 32768, tiny_recipe)
    assert short < long <= 3.49  # chosen for 2K, it leaves bits unspent at 32K; chosen for 32K, it spends them


def test_a_budget_holds_its_bits_on_a_model_with_sliding_window_layers(monkeypatch):
    """Gemma-3's local layers hold their last window - 1 tokens: a budget charges each layer for what it holds,
    so the compressed cache after a 600-token forward holds exactly the bits the choice says (a recipe without
    outliers: nothing left to the text), per element held. Charged as if every layer held every token, the same
    budgets claim other bits than the cache holds."""
    from kvsqueeze.methods import budget as B

    model = _model("gemma3")
    acts = collect(model, random_ids(2, 64, seed=5), sinks=1, progress=False)
    recipe = fit_recipe(model, acts, CalibrationConfig(samples=2, seqlen=64, bits=(2, 3, 4), fractions=(0.0,)),
                        "tiny-gemma3", "random", progress=False)
    assert recipe.meta["model"]["fingerprint"]["layer_windows"] == [8, None]
    ids = random_ids(1, 600, seed=9)

    def held_and_claimed(spec) -> tuple[float, float]:
        B._COMPUTED.clear()
        claimed = B.spec_allocation(spec, recipe).bits
        with kvsqueeze.cache_for(model, recipe, spec) as cache:
            with torch.no_grad():
                model(ids, cache=cache, use_cache=True)
            return cache.memory_report().avg_bits, claimed

    names = ("nuq@3.5:chan:ctx600", "nuq@3.5:r4:chan:ctx600", "nuq@2.7:r4:ctx600")
    for name in names:
        held, claimed = held_and_claimed(parse_method(name))
        assert held == pytest.approx(claimed, rel=1e-12) and held <= parse_method(name).budget, name
    monkeypatch.setattr(B, "held_tokens", lambda recipe, tokens: [tokens] * 2)  # every layer charged as full
    for name in names:
        held, claimed = held_and_claimed(parse_method(name))
        assert abs(held - claimed) > 0.05, name
    B._COMPUTED.clear()


def test_the_simulated_count_equals_the_memory_report_on_sliding_window_layers():
    """The evaluation's bits (`SimulatedQuantization.storage` over `elements`) count a sliding layer as holding its
    last window - 1 tokens, as the compressed cache holds them: after the same 300-token forward both give the
    same bytes and bits per element held (a recipe without outliers: no estimate involved)."""
    model = _model("gemma3")
    acts = collect(model, random_ids(2, 64, seed=5), sinks=1, progress=False)
    recipe = fit_recipe(model, acts, CalibrationConfig(samples=2, seqlen=64, bits=(2, 3, 4), fractions=(0.0,)),
                        "tiny-gemma3", "random", progress=False)
    ids = random_ids(1, 300, seed=4)
    for name in ("nuq3", "nuq@3.5:r4:chan:ctx300", "fp16"):
        report, counted, elements = _held_and_counted(model, recipe, parse_method(name), ids)
        assert sum(counted.values()) == report.total_bytes, name
        assert 8 * sum(counted.values()) / elements == pytest.approx(report.avg_bits, rel=1e-12), name


def _held_and_counted(model, recipe, spec, ids) -> tuple:
    """(the compressed cache's memory report, the evaluation's bytes by component, its elements) after the same
    forward of `ids` through each."""
    from kvsqueeze.integrations.simulate import SimulatedQuantization

    t = ids.shape[1]
    with kvsqueeze.cache_for(model, recipe, spec) as cache:
        with torch.no_grad():
            model(ids, cache=cache, use_cache=True)
        report = cache.memory_report()
    with SimulatedQuantization(model, spec, recipe) as sim:
        with torch.no_grad():
            model(ids, cache=sim.new_cache(), use_cache=True)
        return report, sim.storage(t), sim.elements(t)


def test_the_simulated_count_holds_a_sliding_layer_s_own_outliers():
    """A sliding layer holds the outliers of its last window - 1 tokens, not a share of every token's: with a
    recipe that keeps outliers, the evaluation's bytes equal the compressed cache's report after the same forward
    (they once pro-rated the outliers over every token, which differs where outliers bunch up). `average_bits`
    with the model's windows counts per element held as the cache does."""
    from kvsqueeze.methods import average_bits

    model = _model("gemma3")
    acts = collect(model, random_ids(2, 64, seed=5), sinks=1, progress=False)
    recipe = fit_recipe(model, acts, CalibrationConfig(samples=2, seqlen=64, bits=(2, 3, 4), fractions=(0.0, 0.01),
                                                     ablation=True),
                        "tiny-gemma3", "random", progress=False)
    fp = recipe.meta["model"]["fingerprint"]
    ids = random_ids(1, 300, seed=4)
    ids[0, 200:] = ids[0, 200:] % 7  # the text changes near the end: outliers bunch up there
    for name in ("nuq3-1%", "nuq3-1%:pm", "nuq@16:sink4:ctx300"):
        report, counted, _ = _held_and_counted(model, recipe, parse_method(name), ids)
        assert sum(counted.values()) == report.total_bytes, name
    nominal = average_bits(parse_method("nuq3"), fp["layers"], fp["kv_heads"] * fp["head_dim"], fp["head_dim"], 300,
                           recipe, windows=fp["layer_windows"])
    with kvsqueeze.cache_for(model, recipe, parse_method("nuq3")) as cache:
        with torch.no_grad():
            model(ids, cache=cache, use_cache=True)
        assert nominal == pytest.approx(cache.memory_report().avg_bits, rel=1e-12)


def test_a_budget_names_its_context():
    spec = parse_method("nuq@3.5:r32:chan:ctx32k")
    assert spec.budget_context == 32768 and spec.name == "nuq@3.5:r32:chan:ctx32k"
    assert parse_method("nuq@3.5:ctx2048").name == "nuq@3.5"  # the default context is not written
    assert parse_method("nuq@3.5:ctx3000").name == "nuq@3.5:ctx3000"
    for bad in ("nuq@3.5:ctx0", "nuq@3.5:ctx99999999999"):
        with pytest.raises(MethodError, match="ctx"):
            parse_method(bad)
    with pytest.raises(MethodError, match="out of range"):
        parse_method("nuq3:r99999999999999999999")


def test_padding_words_are_filled_with_upgrades(tiny_recipe):
    """A unit with widths of its own leaves no bit of its last word unused where an upgrade still saves error."""
    alloc = allocate_channels(tiny_recipe, 3.49, window=32)
    for c in (*alloc.keys, *alloc.values):
        if c.widths is not None and sum(c.widths) % 32:
            assert max(c.widths) == 6 or all(w == max(c.widths) for w in c.widths), c


@pytest.mark.parametrize("name", ["int3:sink4", "nf3:sink2", "turbo3:sink4"])
def test_modelled_methods_count_no_sinks_a_sliding_layer_has_moved_past(name):
    """A sliding layer holding its last 7 tokens of a 600-token row keeps none of the row's first tokens: a
    method no kvsqueeze cache holds is charged for its sinks on the full layer only, and for the same sinks on
    both layers while the row is shorter than the window."""
    spec = parse_method(name)
    c, fp16 = 256, storage.FP16_BYTES
    sliding = cache_bytes(spec, 2, c, 64, Rows(600), held=[7, None])
    assert sliding["sinks"] == 2 * fp16 * spec.sinks * c  # keys and values of the full layer's sinks
    short = cache_bytes(spec, 2, c, 64, Rows(6), held=[6, None])
    assert short["sinks"] == 2 * 2 * fp16 * spec.sinks * c
