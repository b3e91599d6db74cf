"""The lm-eval adapter, end to end on local tasks (JSONL + task YAML): the "kvsqueeze" model scores like lm-eval's
own HF model in fp16, quantizes in the forward pass of loglikelihood tasks, and generates what kvsqueeze's own
compressed cache generates."""

import json
import os

import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: no hub is reachable
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lm_eval  # noqa: E402  (a test dependency: a missing lm-eval fails here, it is not skipped)
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from kvsqueeze.integrations.harness import KVSqueezeLM  # noqa: E402
from tests.conftest import byte_tokenizer  # noqa: E402

MC = [{"question": "What color is the sky?", "choices": ["blue", "green", "red"], "label": 0},
      {"question": "How many legs does a dog have?", "choices": ["two", "four", "six"], "label": 1},
      {"question": "Which is a fruit?", "choices": ["stone", "apple", "chair"], "label": 1}]
QA = [{"question": "Capital of France?", "answer": "Paris"}, {"question": "Two plus two is", "answer": "four"},
      {"question": "The cache holds keys and", "answer": "values"},
      # longer than the default method's 32-token window: its answer decodes over codes, not the window alone
      {"question": "A decoder keeps the keys and values of every token it has read so far; a compressed cache keeps "
                   "them in a few bits each. What does it keep?", "answer": "keys and values"}]
PPL = [{"text": "The quick brown fox jumps over the lazy dog. " * 6},
       {"text": "KV cache quantization reduces memory use during long generation. " * 5}]


def _task_dir(tmp):
    data = tmp / "data"
    data.mkdir()
    for name, rows in (("mc", MC), ("qa", QA), ("ppl", PPL)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "kvs_mc.yaml").write_text(f"""task: kvs_mc
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data / 'mc.jsonl'}}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
metadata: {{version: 1.0}}
""")
    (tmp / "kvs_gen.yaml").write_text(f"""task: kvs_gen
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data / 'qa.jsonl'}}}}}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs: {{until: ["\\n"], max_gen_toks: 12, do_sample: false, temperature: 0.0}}
metric_list:
  - {{metric: exact_match, aggregation: mean, higher_is_better: true}}
metadata: {{version: 1.0}}
""")
    (tmp / "kvs_ppl.yaml").write_text(f"""task: kvs_ppl
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data / 'ppl.jsonl'}}}}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - {{metric: word_perplexity}}
metadata: {{version: 1.0}}
""")
    return tmp


@pytest.fixture(scope="module")
def setup(tiny_llama, tiny_recipe_dir, tmp_path_factory):
    """A model directory (the tiny LLaMA, a byte tokenizer with EOS) and the local tasks."""
    d = tmp_path_factory.mktemp("harness-model")
    tok = byte_tokenizer()
    tok.eos_token = "Ċ"
    tiny_llama.save_pretrained(d)
    tok.save_pretrained(d)
    return d, tiny_recipe_dir, _task_dir(tmp_path_factory.mktemp("tasks"))


def _evaluate(lm, tasks_dir, tasks):
    res = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=TaskManager(include_path=str(tasks_dir)),
                                  log_samples=True, bootstrap_iters=0)
    return res


def _metrics(res):
    return {t: {k: v for k, v in r.items() if k.endswith(",none") and "stderr" not in k}
            for t, r in res["results"].items()}


NAMES = ["kvs_mc", "kvs_ppl", "kvs_gen"]


@pytest.fixture(scope="module")
def fp16_metrics(setup):
    model_dir, recipe, tasks = setup
    ours = KVSqueezeLM(pretrained=str(model_dir), method="fp16", batch_size=2)
    return ours, _metrics(_evaluate(ours, tasks, NAMES))


def test_fp16_scores_as_lm_evals_own_hf_model(setup, fp16_metrics):
    ours, a = fp16_metrics
    ref = HFLM(pretrained=ours.model, tokenizer=ours.tokenizer, batch_size=2, max_length=ours.max_length)
    b = _metrics(_evaluate(ref, setup[2], NAMES))
    assert a.keys() == b.keys() == set(NAMES)
    for t in NAMES:
        for k in a[t]:
            assert a[t][k] == pytest.approx(b[t][k], rel=1e-4, abs=1e-6), (t, k)


@pytest.mark.parametrize("method", ["nuq2", None], ids=["nuq2", "default"])
def test_a_quantized_cache_changes_loglikelihoods_and_generates_as_the_compressed_cache(setup, fp16_metrics, method):
    """nuq2, and the default (the 3.5-bit preset, whose fp16 window switches the model to kvsqueeze's attention)."""
    from kvsqueeze import cache_for
    from kvsqueeze.integrations.fused import fused_decode

    model_dir, recipe, tasks = setup
    chosen = {} if method is None else {"method": method}
    q = KVSqueezeLM(pretrained=str(model_dir), recipe=str(recipe), batch_size=1, **chosen)
    res = _evaluate(q, tasks, ["kvs_ppl", "kvs_gen"])
    ppl_fp = fp16_metrics[1]["kvs_ppl"]["word_perplexity,none"]
    ppl_q = _metrics(res)["kvs_ppl"]["word_perplexity,none"]
    assert ppl_q != pytest.approx(ppl_fp, rel=1e-6)  # the forward pass really saw quantized keys and values

    got = [s["resps"][0][0] for s in sorted(res["samples"]["kvs_gen"], key=lambda s: s["doc_id"])]
    tok, model = q.tokenizer, q.model
    assert len(got) == len(QA)
    for doc, text in zip(QA, got):
        ids = tok(f"Q: {doc['question']}\nA:", return_tensors="pt")["input_ids"]
        with cache_for(model, recipe, **chosen) as cache, fused_decode(model, cache), torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=12,
                                 do_sample=False, pad_token_id=tok.pad_token_id)
        own = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split("\n")[0]
        assert text == own


@pytest.mark.parametrize("method", ["kivi2", "int4:sink1"])
def test_methods_without_a_compressed_cache_generate_through_the_simulated_one(setup, method):
    """KIVI and a simulated method with an fp16 sink through their simulation; a batch of two (padded on the left)
    answers as one question at a time does, its rows generated apart so that no padding joins a row's key groups
    or is kept as its sink (the sink's batch of two was refused half way through a run)."""
    model_dir, recipe, tasks = setup
    answers = {}
    for size in (2, 1):
        lm = KVSqueezeLM(pretrained=str(model_dir), method=method, batch_size=size)
        res = _evaluate(lm, tasks, ["kvs_gen"])
        assert len(res["samples"]["kvs_gen"]) == len(QA) and "exact_match,none" in res["results"]["kvs_gen"]
        answers[size] = sorted((s["doc_id"], s["resps"]) for s in res["samples"]["kvs_gen"])
    assert answers[2] == answers[1]


def test_command_line_wrapper_runs_lm_evals_cli(setup, tmp_path):
    from kvsqueeze.integrations.harness import main

    model_dir, recipe, tasks = setup
    out = tmp_path / "results"
    main(["--model", "kvsqueeze", "--model_args", f"pretrained={model_dir},recipe={recipe},method=nuq3-1%",
          "--tasks", "kvs_mc", "--include_path", str(tasks), "--output_path", str(out), "--device", "cpu",
          "--batch_size", "2"])
    written = list(out.rglob("results*.json"))
    assert written and "kvs_mc" in json.loads(written[0].read_text())["results"]


def test_bad_model_args_are_refused_before_loading(setup):
    model_dir, recipe, _ = setup
    with pytest.raises(ValueError, match="loads the tokenizer that comes with the model"):
        KVSqueezeLM(pretrained=str(model_dir), method="fp16", tokenizer="gpt2")
    with pytest.raises(ValueError, match="wider half from the whole batch's tokens.*batch_size=1"):
        KVSqueezeLM(pretrained=str(model_dir), method="turbo3:split", batch_size=4)
    with pytest.raises(ValueError, match="recipe=DIR"):
        KVSqueezeLM(pretrained=str(model_dir), method="nuq3-1%")
    with pytest.raises(Exception, match="unknown method"):
        KVSqueezeLM(pretrained=str(model_dir), method="nuq9x")
