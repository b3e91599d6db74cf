"""The RULER-style suite: seeded contexts that fit, scorers, and the engines' equivalences on tiny models."""

import dataclasses
import re

import pytest
import torch

from kvsqueeze.eval.ruler import MANY, TASKS, RulerError, build_contexts, score_answer
from tests.conftest import byte_tokenizer, random_ids, sample_text, tiny_model

HAY = sample_text(6000, seed=5) + " ".join(f"word{chr(97 + i % 26)}{chr(97 + i // 26 % 26)}x" for i in range(900))


def _pool_text():
    # a haystack with enough distinct words for the word list (letters only, 4-10 long)
    import random

    rng = random.Random(0)
    words = sorted({"".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 9)))
                    for _ in range(3000)})
    # paragraphs of filler and distinct words, so that the evaluation part a file's split holds out has both
    return "\n\n".join(sample_text(80, seed=i).strip() + " " + ". ".join(words[60 * i:60 * (i + 1)]) + "."
                       for i in range(len(words) // 60))


TEXT = _pool_text()


def test_score_is_the_share_of_expected_strings_found():
    assert score_answer(" 123, 456.", ["123", "456"]) == 1.0
    assert score_answer("123", ["123", "456"]) == 0.5
    assert score_answer("Amber", ["amber"]) == 1.0
    assert score_answer("", ["x"]) == 0.0
    with pytest.raises(ValueError):
        score_answer("x", [])


@pytest.mark.parametrize("length", [2048, 4096])
def test_contexts_fit_their_length_and_carry_every_needle_once(length):
    tok = byte_tokenizer()
    contexts = build_contexts(tok, TEXT, length, samples=2, seed=3)
    assert [c.kind for c in contexts] == ["needles", "words", "needles", "words"]
    for c in contexts:
        n = len(tok(c.text)["input_ids"])
        assert n == c.n_tokens and n > length - 400
        for q in c.questions:
            longest = len(tok("\n" + q.text, add_special_tokens=False)["input_ids"]) + q.max_new_tokens
            assert n + longest <= length, q.task  # room for the question and the whole answer
    needles = contexts[0]
    assert {q.task for q in needles.questions} == set(TASKS) - {"cwe", "fwe"}
    for q in needles.questions:
        for a in q.answers:
            assert needles.text.count(a) >= 1, (q.task, a)
    single = next(q for q in needles.questions if q.task == "niah_single_number")
    assert needles.text.count(single.answers[0]) == 1
    vt = next(q for q in needles.questions if q.task == "vt")
    at = [needles.text.index(f"VAR {name} =") for name in vt.answers]
    assert at == sorted(at)  # the chain is in order: each variable after the one it copies
    for a, b in zip(vt.answers, vt.answers[1:]):
        assert f"VAR {b} = VAR {a}." in needles.text
    mk = next(q for q in needles.questions if q.task == "niah_multikey")
    key = re.search(r"for (\S+) mentioned", mk.text).group(1)
    rivals = re.findall(rf"magic numbers for ({key.split('-')[0]}-\S+) is", needles.text)
    assert key in rivals and len(rivals) == 4


@pytest.mark.parametrize("length", [4096, 8192])
def test_the_many_layout_asks_each_task_several_times_each_with_needles_of_its_own(length):
    tok = byte_tokenizer()
    contexts = build_contexts(tok, TEXT, length, samples=2, seed=3, layout="many")
    assert [c.kind for c in contexts] == ["needles", "words", "needles", "words"]
    needles = contexts[0]
    assert needles.text != contexts[2].text
    assert len(needles.questions) == sum(MANY.values()) == 24
    for task, copies in MANY.items():
        assert [q.item for q in needles.questions if q.task == task] == list(range(copies))
    n = len(tok(needles.text)["input_ids"])
    assert n == needles.n_tokens and n + max(len(tok("\n" + q.text, add_special_tokens=False)["input_ids"])
                                             + q.max_new_tokens for q in needles.questions) <= length
    keys = re.findall(r"special magic \w+ for (\S+) is:", needles.text)
    for q in needles.questions:
        for a in q.answers:  # every expected string is in the text, a number or word once
            assert needles.text.count(a) == 1 or q.task == "vt", (q.task, a)
        if q.task.startswith("niah_single"):
            (key,) = set(re.findall(r"for (\S+) mentioned", q.text))
            assert keys.count(key) == 1  # its key has one needle
    multikey = [q for q in needles.questions if q.task == "niah_multikey"]
    firsts = [re.search(r"for (\S+) mentioned", q.text).group(1).split("-")[0] for q in multikey]
    assert len(set(firsts)) == len(firsts)  # each with rivals of its own
    for f in firsts:
        assert sum(k.split("-")[0] == f for k in keys) == 4
    values = [q.text.split("value ")[1].split(" ")[0] for q in needles.questions if q.task == "vt"]
    assert len(set(values)) == MANY["vt"]
    for q in (q for q in needles.questions if q.task == "vt"):
        for a, b in zip(q.answers, q.answers[1:]):
            assert f"VAR {b} = VAR {a}." in needles.text


def test_word_list_counts_and_the_two_questions():
    tok = byte_tokenizer()
    (words,) = build_contexts(tok, TEXT, 4096, 1, tasks=["cwe", "fwe"])
    items = re.findall(r"\d+\. ([a-z]+)", words.text)
    counts = {}
    for w in items:
        counts[w] = counts.get(w, 0) + 1
    cwe, fwe = words.questions
    ranked = sorted(counts, key=counts.get, reverse=True)
    assert set(ranked[:10]) == set(cwe.answers)
    assert list(fwe.answers) == ranked[:3] and counts[ranked[2]] > counts[ranked[3]]
    assert counts[ranked[10]] < counts[ranked[9]]


def test_contexts_are_seeded_and_tasks_validated():
    tok = byte_tokenizer()
    a = build_contexts(tok, TEXT, 2048, 1, seed=1)
    assert a == build_contexts(tok, TEXT, 2048, 1, seed=1)
    assert a[0].text != build_contexts(tok, TEXT, 2048, 1, seed=2)[0].text
    with pytest.raises(RulerError, match="unknown task"):
        build_contexts(tok, TEXT, 2048, 1, tasks=["niah_single_number", "qa"])
    with pytest.raises(RulerError, match="too short"):
        build_contexts(tok, TEXT, 400, 1)
    with pytest.raises(RulerError, match="samples"):
        build_contexts(tok, TEXT, 2048, 0)


# ---- the engines on a tiny model ------------------------------------------------------------------

TINY_TASKS = ["niah_single_number", "niah_multiquery"]


pytestmark = pytest.mark.usefixtures("own_attention")  # a windowed cache selects kvsqueeze's attention


@pytest.fixture(scope="module")
def tiny_setup(tiny_llama, tiny_recipe):
    tok = byte_tokenizer()
    contexts = build_contexts(tok, TEXT, 900, 1, seed=4, tasks=TINY_TASKS)
    return tiny_llama, tok, tiny_recipe, contexts


def _run(setup, methods, engine, **kw):
    from kvsqueeze.eval.ruler_eval import ruler_eval
    from kvsqueeze.methods import parse_methods

    model, tok, recipe, contexts = setup
    return ruler_eval(model, tok, parse_methods(methods), contexts, recipe, engine=engine, chunk=256,
                      progress=False, **kw)


def test_dense_prefill_records_what_a_forward_caches(tiny_llama):
    from transformers import DynamicCache

    from kvsqueeze.integrations.prefill import dense_prefill

    ids = torch.randint(1, 200, (1, 300), generator=torch.Generator().manual_seed(0))
    rec = dense_prefill(tiny_llama, ids, chunk=128)
    ref = DynamicCache()
    with torch.no_grad():
        tiny_llama(input_ids=ids, cache=ref, use_cache=True)
    for i, layer in enumerate(ref.layers):
        torch.testing.assert_close(rec.post_keys[i], layer.keys, rtol=1e-4, atol=1e-5)
        b, h, t, d = layer.values.shape
        torch.testing.assert_close(rec.values[i], layer.values.transpose(1, 2).reshape(b, t, h * d),
                                   rtol=1e-4, atol=1e-5)
    assert rec.positions.tolist() == [list(range(300))]


@pytest.mark.parametrize("method", ["nuq3-1%", "int3:kchan:pre", "nuq2-1%:sink4"])
def test_compressed_and_simulated_fills_hold_the_same_numbers(tiny_llama, tiny_recipe, method):
    from kvsqueeze.integrations.prefill import dense_prefill, filled_cache
    from kvsqueeze.integrations.simulate import SimulatedQuantization
    from kvsqueeze.methods import parse_method

    spec = parse_method(method)
    ids = torch.randint(1, 200, (1, 200), generator=torch.Generator().manual_seed(1))
    rec = dense_prefill(tiny_llama, ids, chunk=64)
    with filled_cache(tiny_llama, tiny_recipe, spec, rec) as cache:
        real = [layer.read(torch.float32) for layer in cache.layers]
        assert cache.get_seq_length() == 200
    with SimulatedQuantization(tiny_llama, spec, tiny_recipe) as sim:
        simulated = filled_cache(tiny_llama, tiny_recipe, spec, rec, sim=sim)
    for (k, v), layer in zip(real, simulated.layers):
        torch.testing.assert_close(k, layer.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, layer.values, rtol=1e-5, atol=1e-5)
        assert not torch.equal(v, rec.values[0])  # quantized: not the recorded values
    k0 = real[0][0]
    assert (k0 - rec.post_keys[0]).abs().max() > 1e-3  # and the keys really went through the quantizer


def test_engines_agree_where_they_should(tiny_setup):
    # the compressed cache and the simulated path, each prefilling through the method: the same answers
    chunked = _run(tiny_setup, "fp16,nuq3-1%,nuq2-1%", "chunked")
    sim = _run(tiny_setup, "fp16,nuq3-1%,nuq2-1%", "sim")
    assert [(a.method, a.task, a.answer) for a in chunked] == [(a.method, a.task, a.answer) for a in sim]
    # fp16 after one dense prefill answers as fp16 prefilled through its own cache, up to fp16 rounding of the
    # context's keys (the same tokens on this model)
    dense = _run(tiny_setup, "fp16", "dense-prefill")
    assert [a.answer for a in dense] == [a.answer for a in chunked if a.method == "fp16"]
    assert all(a.tokens > 600 for a in dense)


def test_each_question_sees_the_context_alone(tiny_setup):
    from kvsqueeze.eval.ruler import Context

    model, tok, recipe, (ctx,) = tiny_setup
    methods = "nuq3-1%,nuq3-1%:r8,kivi2"  # a windowed cache is rolled back to the context, its window included
    both = _run(tiny_setup, methods, "dense-prefill")
    alone = []
    for q in reversed(ctx.questions):  # asked in the other order, each on a fresh context
        one = Context(ctx.kind, ctx.length, ctx.sample, ctx.seed, ctx.text, ctx.n_tokens, (q,))
        alone += _run((model, tok, recipe, [one]), methods, "dense-prefill")
    key = lambda a: (a.method, a.task)  # noqa: E731
    assert sorted((key(a), a.answer) for a in both) == sorted((key(a), a.answer) for a in alone)


def test_questions_asked_together_answer_as_each_alone(tiny_setup, monkeypatch):
    from dataclasses import replace

    from kvsqueeze.eval import ruler_eval as R
    from kvsqueeze.eval.ruler import Context

    model, tok, recipe, (ctx,) = tiny_setup
    width = max(len(q.text) for q in ctx.questions) + 2
    # four distinct questions of equal token count (a byte tokenizer), with different answer limits
    same = [replace(q, text=pad * (width - len(q.text)) + q.text, item=q.item + 10 * (k + 1))
            for k, pad in enumerate(" ;") for q in ctx.questions]
    assert len({len(tok("\n" + q.text, add_special_tokens=False)["input_ids"]) for q in same}) == 1
    assert len({q.max_new_tokens for q in same}) > 1
    wide = Context(ctx.kind, ctx.length, ctx.sample, ctx.seed, ctx.text, ctx.n_tokens, ctx.questions + tuple(same))
    rows = []
    real = R.greedy_rows
    monkeypatch.setattr(R, "greedy_rows",
                        lambda m, t, c, ids, lim: rows.append(ids.shape[0]) or real(m, t, c, ids, lim))
    methods = "fp16,nuq3-1%,nuq@3.5:r8:chan,kivi2,turbo3:split,int4"
    together = _run((model, tok, recipe, [wide]), methods, "dense-prefill")
    assert max(rows) == 4 and len(together) == 6 * len(wide.questions)
    rows.clear()
    alone = _run((model, tok, recipe, [wide]), methods, "dense-prefill", max_rows=1)
    assert set(rows) == {1}
    assert [(a.method, a.task, a.item, a.answer) for a in together] == [(a.method, a.task, a.item, a.answer)
                                                                        for a in alone]
    rows.clear()
    _run((model, tok, recipe, [wide]), "nuq3-1%", "dense-prefill", row_memory=1)  # one row's bytes don't fit
    assert set(rows) == {1}


def test_a_run_resumes_from_its_answer_log(tiny_setup, tmp_path, monkeypatch):
    from kvsqueeze.eval import ruler_eval as R

    log = tmp_path / "answers.jsonl"
    first = _run(tiny_setup, "fp16,nuq3-1%", "dense-prefill", log=R.AnswerLog(log))
    assert len(log.read_text().splitlines()) == len(first) == 2 * len(TINY_TASKS)

    def no_prefill(*a, **k):
        raise AssertionError("a finished context was prefilled again")

    monkeypatch.setattr(R, "dense_prefill", no_prefill)
    again = _run(tiny_setup, "fp16,nuq3-1%", "dense-prefill", log=R.AnswerLog(log))
    assert again == first and len(log.read_text().splitlines()) == len(first)
    monkeypatch.undo()
    more = _run(tiny_setup, "fp16,nuq3-1%,kivi2", "dense-prefill", log=R.AnswerLog(log))
    assert len(more) == 3 * len(TINY_TASKS) and more[:len(first)] == first


def test_answers_of_another_haystack_are_not_taken_for_this_one_s(tiny_setup, tmp_path):
    """The same seed, sample, tasks and length over another haystack make other questions: a log holding the
    first haystack's answers answers them anew, and the two runs' answers are never paired with each other."""
    from kvsqueeze.eval import ruler_eval as R

    model, tok, recipe, contexts = tiny_setup
    other = build_contexts(tok, sample_text(4000, seed=9) + " " + TEXT[-30000:], 900, 1, seed=4, tasks=TINY_TASKS)
    assert [(c.length, c.sample, c.seed) for c in other] == [(c.length, c.sample, c.seed) for c in contexts]
    log = tmp_path / "answers.jsonl"
    first = _run(tiny_setup, "fp16,nuq3-1%", "dense-prefill", log=R.AnswerLog(log))
    second = _run((model, tok, recipe, other), "fp16,nuq3-1%", "dense-prefill", log=R.AnswerLog(log))
    assert len(log.read_text().splitlines()) == len(first) + len(second) == 4 * len(TINY_TASKS)
    assert not {a.key for a in first} & {a.key for a in second}
    assert all(a.context for a in first + second)
    (p,) = R.paired(R.AnswerLog(log).answers)
    assert p.questions == 2 * len(TINY_TASKS)  # each question with its own run's fp16 answer


def test_a_stored_prefill_survives_a_stopped_run_and_goes_once_answered(tiny_setup, tmp_path, monkeypatch):
    from kvsqueeze.eval import ruler_eval as R
    from kvsqueeze.integrations.prefill import DensePrefill

    store = tmp_path / "prefills"
    plain = _run(tiny_setup, "fp16,nuq3-1%", "dense-prefill")
    real = R.greedy_rows

    def stop(*a):
        raise KeyboardInterrupt

    monkeypatch.setattr(R, "greedy_rows", stop)
    with pytest.raises(KeyboardInterrupt):
        _run(tiny_setup, "fp16,nuq3-1%", "dense-prefill", prefill_store=store)
    (kept,) = store.iterdir()
    model, tok, _, (ctx,) = tiny_setup
    ids = tok(ctx.text, return_tensors="pt")["input_ids"]
    saved = DensePrefill.load(kept, ids)
    fresh = R.dense_prefill(model, ids, 256)
    for part in ("pre_keys", "post_keys", "values"):
        assert all(torch.equal(a, b) for a, b in zip(getattr(saved, part), getattr(fresh, part)))
    with pytest.raises(ValueError, match="other tokens"):
        DensePrefill.load(kept, ids[:, 1:])

    def no_prefill(*a, **k):
        raise AssertionError("the stored prefill was run again")

    monkeypatch.setattr(R, "greedy_rows", real)
    monkeypatch.setattr(R, "dense_prefill", no_prefill)
    again = _run(tiny_setup, "fp16,nuq3-1%", "dense-prefill", prefill_store=store)
    assert [a.answer for a in again] == [a.answer for a in plain]
    assert not any(store.iterdir())  # every method answered: the file is gone


def test_summary_averages_tasks_and_compares_with_fp16(tiny_setup):
    from kvsqueeze.eval.ruler_eval import Answer, format_ruler_table, summarize

    rows = [Answer("m", meth, "dense-prefill", t, 4096, s, s, 100, sc, "", ("x",))
            for meth, scores in (("fp16", (1, 1, 1, 0)), ("nuq3-1%", (1, 0, 1, 0)))
            for (t, s), sc in zip([("vt", 0), ("cwe", 0), ("vt", 1), ("cwe", 1)], scores)]
    scores = {(s.method, s.task): s for s in summarize(rows)}
    assert scores[("fp16", "vt")].score == 100 and scores[("fp16", "cwe")].score == 50
    assert scores[("fp16", "average")].score == 75 and scores[("nuq3-1%", "average")].score == 50
    assert scores[("nuq3-1%", "average")].samples == 2
    assert "67%" in format_ruler_table(list(scores.values()))


def test_sliding_window_models_are_refused_before_any_prefill():
    from kvsqueeze.integrations.preflight import UnsupportedModelError
    from kvsqueeze.integrations.prefill import dense_prefill

    model = tiny_model("mistral", seed=1, sliding_window=64)
    with pytest.raises(UnsupportedModelError, match="sliding-window.*chunked"):
        dense_prefill(model, torch.ones(1, 10, dtype=torch.long), engine_hint="use --engine chunked")


@pytest.mark.parametrize("method", ["nuq3-1%", "nuq3-1%:r4"])
def test_the_chunked_engine_answers_on_a_sliding_window_model_from_the_context_alone(method):
    """The engine the dense prefill's refusal points to: a sliding layer drops its oldest tokens as a question
    runs and cannot roll back to the context, so questions are asked of a copy. Two batches of questions asked
    one after the other answer as each asked of its own fresh cache (they once failed after the first batch)."""
    from kvsqueeze.calibrate.collect import collect
    from kvsqueeze.calibrate.fit import CalibrationConfig, fit_recipe
    from kvsqueeze.eval.ruler_eval import _Method
    from kvsqueeze.methods import parse_method

    model = tiny_model("mistral", seed=1, sliding_window=8)
    acts = collect(model, random_ids(2, 64, seed=5), sinks=1, progress=False)
    recipe = fit_recipe(model, acts, CalibrationConfig(samples=2, seqlen=64, bits=(3,), fractions=(0.0, 0.01)),
                        "tiny-mistral", "random", progress=False)
    tok = byte_tokenizer()
    ctx, first, second = random_ids(1, 20, seed=1), random_ids(2, 4, seed=2), random_ids(1, 3, seed=3)
    with _Method(model, tok, parse_method(method), recipe, "chunked", 16) as m:
        cache = m.cache(ctx, None)
        got = [m.answer(cache, first, [3, 3]), m.answer(cache, second, [3])]
        assert cache.get_seq_length() == 20
        want = []
        for q, limits in ((first, [3, 3]), (second, [3])):
            fresh = m.cache(ctx, None)
            want.append(m.answer(fresh, q, limits))
    assert got == want


def test_bad_engine_and_too_long_lengths_are_refused(tiny_setup):
    with pytest.raises(ValueError, match="engine"):
        _run(tiny_setup, "fp16", "gpu")
    with pytest.raises(ValueError, match="max_rows and row_memory must be positive"):
        _run(tiny_setup, "fp16", "dense-prefill", max_rows=0)
    model, tok, recipe, _ = tiny_setup
    long = build_contexts(tok, TEXT, 2048, 1, tasks=TINY_TASKS)
    with pytest.raises(ValueError, match="1024-token context"):
        _run((model, tok, recipe, long), "fp16", "dense-prefill")


def test_ruler_cli_on_a_tiny_model(tiny_model_dir, tiny_recipe_dir, tmp_path, capsys):
    import json

    from kvsqueeze.cli import main

    text = tmp_path / "hay.txt"
    text.write_text(TEXT)
    out, answers, png = tmp_path / "r.json", tmp_path / "answers.jsonl", tmp_path / "r.png"
    argv = ["ruler", "--model", str(tiny_model_dir), "--recipe", str(tiny_recipe_dir), "--methods", "fp16,nuq3-1%",
            "--lengths", "900", "--tasks", ",".join(TINY_TASKS), "--samples", "1", "--text", str(text),
            "--layout", "shared", "--chunk", "256", "--answers", str(answers), "--json", str(out), "--plot", str(png),
            "--prefills", str(tmp_path / "prefills")]
    assert main(argv) == 0
    assert not any((tmp_path / "prefills").iterdir())  # kept while the context was asked, gone once answered
    printed = capsys.readouterr().out
    assert "RULER-style average score" in printed and "nuq3-1%" in printed
    rows = json.loads(out.read_text())["rows"]
    assert {(r["method"], r["task"]) for r in rows} == {(m, t) for m in ("fp16", "nuq3-1%")
                                                        for t in TINY_TASKS + ["average"]}
    asked = 2 * len(TINY_TASKS)  # one question a task in the shared layout (the tiny model's 1K is short for many)
    assert png.stat().st_size > 1000 and len(answers.read_text().splitlines()) == asked
    assert main(argv) == 0  # resumed: nothing left to ask
    assert len(answers.read_text().splitlines()) == asked


@pytest.mark.parametrize("extra, message", [
    (["--tasks", "niah_single_number,qa"], "unknown task"),
    (["--engine", "gpu"], "--engine"),
    (["--lengths", "4096"], "exceed(s) the model's 1024-token context"),
    (["--samples", "0"], "--samples"),
])
def test_ruler_cli_refuses_bad_input(tiny_model_dir, tiny_recipe_dir, tmp_path, capsys, extra, message):
    from kvsqueeze.cli import main

    text = tmp_path / "hay.txt"
    text.write_text(TEXT)
    argv = ["ruler", "--model", str(tiny_model_dir), "--recipe", str(tiny_recipe_dir), "--methods", "fp16",
            "--lengths", "900", "--text", str(text), *extra]
    try:
        rc = main(argv)
    except SystemExit as exc:  # an option out of range is refused when parsed
        rc = exc.code
    assert rc == 2
    assert message in capsys.readouterr().err


def test_ruler_cli_refuses_two_names_of_one_method_at_a_length_before_loading(tmp_path, capsys, monkeypatch):
    """`q3.5` at 900 tokens is the 2,048-token choice `nuq@3.5:r32:chan`, as `eval`, `generate`, `passkey` and
    `memory` choose it for a cache reaching fewer tokens: the pair is refused before the model loads."""
    import kvsqueeze.integrations.loading as loading
    from kvsqueeze.cli import main

    def never(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loading, "load_model", never)
    text = tmp_path / "hay.txt"
    text.write_text(TEXT)
    argv = ["ruler", "--model", "tiny", "--methods", "fp16,q3.5,nuq@3.5:r32:chan", "--lengths", "900",
            "--text", str(text)]
    assert main(argv) == 2
    assert "same method" in capsys.readouterr().err


def test_paired_differences_match_questions_one_to_one():
    from kvsqueeze.eval.ruler_eval import Answer, paired

    rows = [Answer("m", meth, "e", t, 4096, s, s, 100, sc, "", ("x",))
            for meth, scores in (("fp16", (1, 1, 0.5, 0)), ("nuq3-1%", (1, 0, 0.5, 0)))
            for (t, s), sc in zip([("vt", 0), ("cwe", 0), ("vt", 1), ("cwe", 1)], scores)]
    (p,) = paired(rows)
    assert p.method == "nuq3-1%" and p.questions == 4 and p.diff == -25.0
    assert p.ci95[0] <= -25.0 <= p.ci95[1] and p.share == pytest.approx(1.5 / 2.5, abs=1e-3)
    assert (p.score, p.reference_score) == (37.5, 62.5)
    assert p.reference_right == 2 and p.on_reference_right == 50.0  # fp16 fully right on two; the method on one


def test_pooled_pairs_keep_each_length_s_questions_apart():
    from kvsqueeze.eval.ruler_eval import Answer, paired

    # the same task, sample and item at two lengths are two questions: the method loses one at 4K, none at 8K
    rows = [Answer("m", meth, "e", "vt", n, 0, 7, 100, sc, "", ("x",))
            for n, scores in ((4096, (1, 0)), (8192, (1, 1))) for meth, sc in zip(("fp16", "q3.5"), scores)]
    by_length = {p.length: p for p in paired(rows)}
    assert by_length[4096].diff == -100.0 and by_length[8192].diff == 0.0
    (pooled,) = paired(rows, by_length=False)
    assert pooled.length == 0 and pooled.questions == 2 and pooled.diff == -50.0
    assert pooled.ci95[0] <= -50.0 <= pooled.ci95[1]
    default = [dataclasses.replace(a, method="nuq3-1%") for a in rows if a.method == "fp16"]
    (head,) = paired([a for a in rows if a.method == "q3.5"] + default, reference="nuq3-1%", by_length=False)
    assert head.method == "q3.5" and head.diff == -50.0  # against another method, as against fp16


def test_a_cell_s_interval_does_not_move_when_other_cells_gain_answers():
    from kvsqueeze.eval.ruler_eval import Answer, paired

    scores = {"fp16": (1, 1, 0, 1, 1, 0, 1, 1), "q3.5": (1, 0, 0, 1, 0, 1, 1, 0), "kivi2": (0, 0, 0, 1, 0, 0, 1, 0)}
    rows = [Answer("m", meth, "e", "vt", 4096, item % 4, 7 + item % 4, 100, sc, "", ("x",), item)
            for meth, row in scores.items() for item, sc in enumerate(row)]
    alone = {p.method: p for p in paired([a for a in rows if a.method != "kivi2"])}
    both = {p.method: p for p in paired(rows)}
    assert alone["q3.5"] == both["q3.5"] and alone["q3.5"].ci95[0] < alone["q3.5"].ci95[1]
    # and the same cell listed after another one draws the same resamples
    assert {p.method: p for p in paired(rows[::-1])}["q3.5"] == both["q3.5"]


def test_paired_intervals_draw_a_context_s_questions_together():
    """Ten questions on each of two contexts: the method loses every question of one and none of the other. Drawn
    as contexts, the mean difference is -100, -50 or 0 points, and the interval spans them; drawn as twenty
    independent questions it would be about -50 +- 22."""
    from kvsqueeze.eval.ruler_eval import Answer, paired

    rows = [Answer("m", meth, "e", "vt", 4096, sample, 100 + sample, 100, sc, "", ("x",), item)
            for sample in (0, 1) for item in range(10)
            for meth, sc in (("fp16", 1.0), ("q3.5", 0.0 if sample == 0 else 1.0))]
    (p,) = paired(rows)
    assert (p.questions, p.contexts, p.samples, p.diff) == (20, 2, 2, -50.0)
    assert p.ci95 == (-100.0, 100.0)  # -50 +- 12.7 * 50, clipped: two samples tell next to nothing
    (one,) = paired([a for a in rows if a.sample == 0])
    assert one.diff == -100.0 and one.ci95 is None  # one sample: no interval at all


def test_a_sample_s_contexts_are_drawn_together():
    """In layout `many` a sample asks 24 questions on its needles context and 2 on its words context (another
    seed): the interval is over samples, so no draw holds only word questions, and with few samples it is as
    wide as their spread says (Student's t), not the narrow range a percentile bootstrap gives."""
    from kvsqueeze.eval.ruler_eval import Answer, cluster_interval, paired

    rows = []
    for sample, (needles, words) in enumerate(((-12.5, 0.0), (-12.5, 0.0), (-8.0, 5.0), (-16.0, -5.0))):
        for meth in ("fp16", "q3.5"):
            lost = round(-needles / 100 * 24) if meth == "q3.5" else 0
            rows += [Answer("m", meth, "e", "niah_single_number", 4096, sample, 100 + sample, 100,
                            0.0 if i < lost else 1.0, "", ("x",), i) for i in range(24)]
            rows += [Answer("m", meth, "e", "cwe", 4096, sample, 900 + sample, 100,
                            0.5 + (words / 100 if meth == "q3.5" else 0.0), "", ("x",), i) for i in range(2)]
    (p,) = paired(rows)
    assert (p.samples, p.contexts, p.questions) == (4, 8, 104)
    sums = {s: sum(100 * (a.score - b.score) for a, b in zip(
        [r for r in rows if r.method == "q3.5" and r.sample == s], [r for r in rows if r.method == "fp16"
                                                                    and r.sample == s])) for s in range(4)}
    assert p.ci95 == tuple(round(x, 2) for x in cluster_interval(list(sums.values()), [26] * 4, -100.0, 100.0))
    means = [sums[s] / 26 for s in range(4)]
    assert p.ci95[0] < min(means) and p.ci95[1] > max(means) and p.ci95[1] < 0.0


def test_the_average_s_interval_is_about_the_average_it_is_shown_with():
    """Tasks count once each in the average however many questions they ask (24 needle answers, all right, and
    one word answer at 0.1-0.2 a sample): each sample's share of the interval is taken the same way, so the
    interval holds the average."""
    from kvsqueeze.eval.ruler_eval import Answer, summarize

    rows = [Answer("m", "fp16", "e", "niah_single_number", 4096, s, s, 100, 1.0, "", ("x",), i)
            for s in range(4) for i in range(24)]
    rows += [Answer("m", "fp16", "e", "cwe", 4096, s, s, 100, 0.1 + 0.1 * (s % 2), "", ("x",)) for s in range(4)]
    (avg,) = [s for s in summarize(rows) if s.task == "average"]
    # samples average 55 and 60 in turn: 57.5 +- 3.182 * 2.887 / 2
    assert avg.score == 57.5 and avg.ci95 == (52.91, 62.09)


def test_paired_questions_are_told_apart_by_item():
    from kvsqueeze.eval.ruler_eval import Answer, paired

    # two questions of one task in one context: item 0 fp16 right and the method wrong, item 1 the reverse
    rows = [Answer("m", meth, "e", "vt", 4096, 0, 7, 100, sc, "", ("x",), item)
            for meth, scores in (("fp16", (1, 0)), ("q3.5", (0, 1))) for item, sc in enumerate(scores)]
    (p,) = paired(rows)
    assert p.questions == 2 and p.diff == 0.0 and p.reference_right == 1 and p.on_reference_right == 0.0
    assert len({a.key for a in rows}) == 4


def test_answers_name_the_method_recipe_and_dtype_they_came_from(tiny_setup, tiny_recipe_dir):
    """Each answer row names the method its label resolved to, the recipe digest where the method reads one and
    the model's dtype, so a summary can refuse a cell whose answers came from two of any."""
    from kvsqueeze.recipe import Recipe

    model, tok, _, contexts = tiny_setup
    recipe = Recipe.load(tiny_recipe_dir)  # a saved recipe: its digest is that of its tensors' bytes
    answers = _run((model, tok, recipe, contexts), "fp16,nuq3-1%", "chunked")
    by = {a.method: a for a in answers}
    assert by["nuq3-1%"].spec == "nuq3-1%" and by["nuq3-1%"].recipe == recipe.meta["tensors_sha256"] != ""
    assert by["fp16"].recipe == ""  # fp16 reads no recipe: its answers pair with any recipe's
    assert {a.dtype for a in answers} == {"float32"}


def _half_written(tmp_path):
    """An answers file of one whole row and the first 40 characters of the next: (its path, the whole row)."""
    from kvsqueeze.eval.ruler_eval import Answer, AnswerLog

    path = tmp_path / "a.jsonl"
    AnswerLog(path).add(Answer("m", "fp16", "dense-prefill", "vt", 4096, 0, 7, 100, 1.0, "x", ("x",)))
    whole = path.read_text()
    path.write_text(whole + whole[:40])
    return path, whole


def test_an_answer_row_cut_short_at_the_end_is_dropped_and_asked_again(tmp_path):
    """A run stopped while appending an answer: the half line is dropped with a warning (its question is asked
    again), where before the file could not be read until edited by hand."""
    from kvsqueeze.eval.ruler_eval import AnswerLog

    path, whole = _half_written(tmp_path)
    with pytest.warns(UserWarning, match="cut short"):
        again = AnswerLog(path)
    assert len(again.answers) == 1 and path.read_text() == whole


def test_a_reader_beside_a_running_append_leaves_the_answers_file_as_it_is(tmp_path):
    """A summary reads the file while a run appends to it: a line it sees half written is skipped, not cut from
    the file (which would lose what the run writes meanwhile); a whole last row without its newline gets one from
    the appending process, so its next row starts a line of its own."""
    from kvsqueeze.eval.ruler_eval import Answer, AnswerLog

    path, whole = _half_written(tmp_path)
    with pytest.warns(UserWarning, match="skipped"):
        assert len(AnswerLog(path, repair=False).answers) == 1
    assert path.read_text() == whole + whole[:40]
    path.write_text(whole.rstrip("\n"))
    AnswerLog(path).add(Answer("m", "q3.5", "dense-prefill", "vt", 4096, 0, 7, 100, 1.0, "x", ("x",)))
    assert len(AnswerLog(path).answers) == 2 and path.read_text().count("\n") == 2


def test_an_answers_file_with_a_bad_row_before_its_end_is_refused_with_the_line(tmp_path):
    """Only the last line can be an append cut short; a bad row elsewhere (a record of another file, a line cut in
    the middle by an edit) stops the run with its line number instead of being skipped without a word."""
    from kvsqueeze.eval.ruler_eval import AnswerLog

    path, whole = _half_written(tmp_path)
    path.write_text(whole + '{"model": "m"}\n' + whole)
    with pytest.raises(ValueError, match=r"a.jsonl:2 is not an answer row of this suite"):
        AnswerLog(path)
    path.write_text(whole[:40] + "\n" + whole)
    with pytest.raises(ValueError, match=r"a.jsonl:1 is not a JSON record"):
        AnswerLog(path, repair=False)
    assert path.read_text() == whole[:40] + "\n" + whole  # refused, not repaired
