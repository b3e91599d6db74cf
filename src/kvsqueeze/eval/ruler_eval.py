"""Run the RULER-style suite (`ruler.py`) on a model, method by method, through the quantized cache.

Engines (`ENGINES`), i.e. how a context reaches each method's cache:

* ``dense-prefill`` (default; what a server does): the context is prefilled
  once with exact attention (`integrations.prefill.dense_prefill`, in chunks);
  each method quantizes those same keys and values into its own cache; the
  question is then read and the answer decoded greedily from that cache — the
  compressed cache with the fused decode kernel for the methods it stores, the
  simulated cache for the others (KIVI, per-token int, turbo). One prefill
  serves every method and every question of the context.
* ``chunked``: each method prefills the context itself, `chunk` tokens at a
  time through its own cache, so each chunk attends to the quantized chunks
  before it (quantization error also shapes the context's own hidden states,
  as in a server with chunked prefill over a compressed cache); the prefill is
  paid once per method.
* ``sim``: like ``chunked``, every method through the simulated path (fake
  quantization); agrees with ``chunked`` on the compressed cache's methods.

Questions are answered in batches: those of one context whose question has
the same number of tokens are asked together, each in a row of its own (the
cache's context repeated per row, `batch_repeat_interleave`), so one forward
reads the model's weights for all of them (with `skinny.skinny_linears`,
which reads them once per call for a few rows). Rows need no padding, so each row
computes what it would alone (up to the rounding of batched matrix products);
a row that has ended leaves the batch (`batch_select_indices`). Rows
per batch are capped by `max_rows` and by `row_memory` (bytes of the repeated
caches). After each batch the cache returns to one row and to the context
(`CompressedCache.rollback`, its fp16 window as it was; other caches are
cropped), so the questions of one context are independent. Answers are greedy, end
at a newline or EOS, and are scored by `ruler.score_answer`. `AnswerLog` appends every answer to a
JSONL file as it is made, and a run given the same file skips what it holds:
long runs resume where they stopped.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..integrations.prefill import DensePrefill, check_full_attention, compressed, dense_prefill, filled_cache
from ..integrations.simulate import SimulatedQuantization
from ..methods import MethodSpec, needs_recipe
from ..recipe import Recipe
from ..shape import context_length
from .records import read_jsonl
from .ruler import TASKS, Context, Question, question_digest, score_answer
from .skinny import skinny_linears
from .stats import cluster_interval
from .tables import text_table

ENGINES = ("dense-prefill", "chunked", "sim")


@dataclass(frozen=True)
class Answer:
    """One method's answer to one question."""

    model: str
    method: str
    engine: str
    task: str
    length: int
    sample: int
    seed: int
    tokens: int  # context + question tokens
    score: float
    answer: str
    expected: tuple[str, ...]
    item: int = 0  # which of the context's questions of this task (`Question.item`)
    context: str = ""  # `ruler.question_digest` of its context and question ("" in logs from before it)
    spec: str = ""  # the method the label resolved to (a preset's budget at this length; "" in older logs)
    recipe: str = ""  # the recipe's `tensors_sha256` where the method reads one ("" where it does not, or older)
    dtype: str = ""  # the model's dtype ("" in older logs)

    @property
    def key(self) -> tuple:
        return (self.model, self.method, self.engine, self.task, self.length, self.sample, self.seed, self.item,
                self.context)

    @property
    def question(self) -> tuple:
        """The question answered, whatever the method: what paired comparisons match on."""
        return (self.model, self.engine, self.length, self.task, self.sample, self.seed, self.item, self.context)


class AnswerLog:
    """Answers appended to a JSONL file as they are made; those already there are not asked again."""

    def __init__(self, path: str | Path | None = None, repair: bool = True):
        """`repair`: this process appends to the file (`records.read_jsonl`: a last line cut short by a run stopped
        while writing it is dropped and its question asked again); a reader alone (a summary, beside a run that
        may be appending) leaves the file as it is and skips such a line."""
        self.path = Path(path) if path is not None else None
        self.answers: list[Answer] = []
        self._keys: set[tuple] = set()
        for n, row in read_jsonl(self.path, repair, "dropped, its question is asked again") if self.path else ():
            try:
                ans = Answer(**{**row, "expected": tuple(row["expected"])})
            except (TypeError, KeyError) as exc:
                raise ValueError(f"{self.path}:{n} is not an answer row of this suite ({exc!r}); give another "
                                 "--answers file or remove that line") from exc
            self._remember(ans)

    def _remember(self, ans: Answer) -> None:
        if ans.key not in self._keys:
            self._keys.add(ans.key)
            self.answers.append(ans)

    def has(self, key: tuple) -> bool:
        return key in self._keys

    def add(self, ans: Answer) -> None:
        self._remember(ans)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:
                f.write(json.dumps(asdict(ans)) + "\n")


def _question_ids(tok, question: Question) -> list[int]:
    return tok("\n" + question.text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def greedy_rows(model, tok, cache, ids: torch.Tensor, limits: Sequence[int]) -> list[str]:
    """Greedy continuations of the cached context, row b by `ids[b]` ([B, T]; the cache holds B rows), each to
    the end of its answer's first line of content (`_ended`), EOS or `limits[b]` new tokens. Rows that have
    ended leave the cache (`batch_select_indices`) before the next step, so the others do not pay for them."""
    if len(limits) != ids.shape[0]:
        raise ValueError(f"{ids.shape[0]} rows of question tokens but {len(limits)} token limits")
    eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    outs: list[list[int]] = [[] for _ in limits]
    live = [b for b, limit in enumerate(limits) if limit > 0]  # the rows the cache holds, in its order
    if live and len(live) < len(limits):
        cache.batch_select_indices(torch.tensor(live, dtype=torch.long))
        ids = ids[live]
    step = ids
    while live:
        logits = model(input_ids=step, cache=cache, use_cache=True, logits_to_keep=1).logits
        nxt = logits[:, -1].argmax(-1).tolist()
        keep = []
        for i, (b, token) in enumerate(zip(live, nxt)):
            if token in eos:
                continue
            outs[b].append(token)
            if len(outs[b]) < limits[b] and not _ended(tok.decode(outs[b], skip_special_tokens=True)):
                keep.append(i)
        if len(keep) < len(live) and keep:
            cache.batch_select_indices(torch.tensor(keep, dtype=torch.long))
        live = [live[i] for i in keep]
        step = torch.tensor([[nxt[i]] for i in keep], device=ids.device)
    return [_first_line(tok.decode(out, skip_special_tokens=True)) for out in outs]


def greedy(model, tok, cache, ids: torch.Tensor, max_new_tokens: int) -> str:
    """`greedy_rows` of one row: the greedy answer to `ids` [1, T] from a one-row cache."""
    return greedy_rows(model, tok, cache, ids, [max_new_tokens])[0]


def _ended(text: str) -> bool:
    """An answer ends at a newline that follows some letters or digits (a list may start on the next line)."""
    cut = text.find("\n")
    while cut >= 0:
        if any(ch.isalnum() for ch in text[:cut]):
            return True
        cut = text.find("\n", cut + 1)
    return False


def _first_line(text: str) -> str:
    """The answer up to the newline `_ended` stops at (newlines before any letter or digit become spaces)."""
    out = []
    for line in text.split("\n"):
        out.append(line)
        if any(ch.isalnum() for ch in line):
            break
    return " ".join(x.strip() for x in out if x.strip())


def _prefill(model, ids: torch.Tensor, chunk: int, hint: str, stored: Path | None) -> DensePrefill:
    """The context's dense prefill: read from `stored` when a stopped run left it there, else run (and kept
    there)."""
    if stored is not None and stored.is_file():
        try:
            return DensePrefill.load(stored, ids)
        except ValueError:
            stored.unlink()  # another context's, or unreadable: prefilled again below
    prefill = dense_prefill(model, ids, chunk, hint)
    if stored is not None:
        prefill.save(stored)
    return prefill


def _batches(questions: Sequence[Question], tokens: Sequence[list[int]], rows: int):
    """The questions with their tokens, in batches of at most `rows` whose questions have equal token counts
    (first by the order each count first appears, then in the order given)."""
    by_len: dict[int, list] = {}
    for q, t in zip(questions, tokens):
        by_len.setdefault(len(t), []).append((q, t))
    for group in by_len.values():
        for s in range(0, len(group), rows):
            yield group[s:s + rows]


def _cache_bytes(cache) -> int:
    """Bytes one row of `cache` holds: its memory report's allocation, else its layers' tensors."""
    if hasattr(cache, "memory_report"):
        return cache.memory_report().capacity_bytes
    return sum(v.numel() * v.element_size() for layer in cache.layers for v in vars(layer).values()
               if isinstance(v, torch.Tensor))


class _Method:
    """One method's way to a cache holding a context, and to answers from it."""

    def __init__(self, model, tok, spec: MethodSpec, recipe: Recipe | None, engine: str, chunk: int):
        self.model, self.tok, self.spec, self.recipe, self.engine, self.chunk = model, tok, spec, recipe, engine, chunk
        self.real = compressed(spec) and engine != "sim"
        self.sim = None if self.real else SimulatedQuantization(model, spec, recipe)

    def __enter__(self) -> "_Method":
        if self.sim is not None:
            self.sim.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.sim is not None:
            self.sim.__exit__(*exc)

    @torch.no_grad()
    def cache(self, ids: torch.Tensor, prefill):
        if self.engine == "dense-prefill":
            return filled_cache(self.model, self.recipe, self.spec, prefill, self.sim)
        if self.real:
            from ..integrations.cache import cache_for

            cache = cache_for(self.model, self.recipe, self.spec)
        else:
            cache = self.sim.new_cache()
        for s in range(0, ids.shape[1], self.chunk):
            self.model(input_ids=ids[:, s:s + self.chunk], cache=cache, use_cache=True, logits_to_keep=1)
        return cache

    def answer(self, cache, ids: torch.Tensor, limits: Sequence[int]) -> list[str]:
        """Answers to the questions `ids` [B, T] (one row each) from a one-row cache holding the context, which
        is left as it was: back to one row and to the context, a compressed cache's fp16 window included
        (`CompressedCache.rollback`; cropping alone would leave the context's last tokens in their codes)."""
        if any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", ())):
            # a sliding layer drops its oldest tokens as the questions run, so it cannot return to the context:
            # the questions are asked of a copy (the cache is compressed: a copy is small beside the model)
            work = copy.deepcopy(cache)
            try:
                return self._answer(work, ids, limits, restore=False)
            finally:
                self.close(work)
        return self._answer(cache, ids, limits)

    def _answer(self, cache, ids: torch.Tensor, limits: Sequence[int], restore: bool = True) -> list[str]:
        start, rows = cache.get_seq_length(), ids.shape[0]
        mark = cache.checkpoint() if restore and hasattr(cache, "checkpoint") else None
        if rows > 1:
            cache.batch_repeat_interleave(rows)
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(skinny_linears(self.model))  # the weights are what a token costs here
                if self.real and self.spec.quantized:
                    from ..integrations.fused import fused_decode

                    stack.enter_context(fused_decode(self.model, cache))
                return greedy_rows(self.model, self.tok, cache, ids, limits)
        finally:
            if restore:  # a copy is dropped after, as it is
                if rows > 1:  # whichever rows are left: each holds the context
                    cache.batch_select_indices(torch.zeros(1, dtype=torch.long))
                if mark is not None:
                    cache.rollback(mark)  # back to the context for the next questions
                else:
                    cache.crop(start - cache.get_seq_length())

    @staticmethod
    def close(cache) -> None:
        if hasattr(cache, "close"):
            cache.close()


def ruler_eval(model, tok, specs: Sequence[MethodSpec], contexts: Sequence[Context], recipe: Recipe | None = None,
               engine: str = "dense-prefill", chunk: int = 2048, model_name: str | None = None,
               log: AnswerLog | None = None, progress: bool = True,
               labels: dict[str, str] | None = None, max_rows: int = 24,
               row_memory: int = 4 << 30, prefill_store: str | Path | None = None) -> list[Answer]:
    """Every method's answers to every question of `contexts` (the log's earlier answers included).

    Contexts are taken in the order given (sample-major orders keep a stopped run balanced over lengths).
    `labels`: the name answers are logged under, by the spec's name (a preset's short name for the budget it
    resolves to at this length); others are logged under their own names. Questions of equal token length are
    answered together, at most `max_rows` at a time and as many as `row_memory` bytes of the method's cache
    repeated per row hold (at least one). `prefill_store`: a folder where each context's dense prefill is kept
    until every method has answered its questions, so that a run stopped in between does not prefill it again.
    """
    from tqdm.auto import tqdm

    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if max_rows < 1 or row_memory < 1:
        raise ValueError(f"max_rows and row_memory must be positive, got {max_rows} and {row_memory}")
    log = log if log is not None else AnswerLog()
    name = model_name or str(getattr(model.config, "name_or_path", "model"))
    limit = context_length(model.config)
    device = next(model.parameters()).device
    hint = "Use engine='chunked' (--engine chunked): each method then prefills through its own cache"
    if engine == "dense-prefill":
        check_full_attention(model, hint)
    for c in contexts:
        if limit and c.length > limit:
            raise ValueError(f"length {c.length} exceeds the model's {limit}-token context; use lengths up to "
                             f"{limit}")

    labels = labels or {}
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    digest = str(recipe.meta.get("tensors_sha256") or "") if recipe is not None else ""

    def label(spec) -> str:
        return labels.get(spec.name, spec.name)

    def key(spec, c, q):
        return (name, label(spec), engine, q.task, c.length, c.sample, c.seed, q.item, question_digest(c, q))

    todo = [(c, [s for s in specs if any(not log.has(key(s, c, q)) for q in c.questions)]) for c in contexts]
    total = sum(len(ss) * len(c.questions) for c, ss in todo)
    bar = tqdm(total=total, desc="ruler", disable=not progress, unit="answer")
    try:
        for c, pending in todo:
            if not pending:
                continue
            ids = tok(c.text, return_tensors="pt")["input_ids"].to(device)
            bar.set_postfix_str(f"{c.kind} @ {c.length}, sample {c.sample}: prefill")
            t0 = time.perf_counter()
            stored = None
            if engine == "dense-prefill" and prefill_store is not None:
                tag = f"{name.replace('/', '_')}.{c.kind}.{c.length}.{c.sample}.{c.seed}.{chunk}"
                tag += "" if dtype == "float32" else f".{dtype}"  # a prefill of another dtype is another prefill
                stored = Path(prefill_store) / f"{tag}.safetensors"
            prefill = _prefill(model, ids, chunk, hint, stored) if engine == "dense-prefill" else None
            bar.set_postfix_str(f"{c.kind} @ {c.length}, sample {c.sample} (prefill {time.perf_counter() - t0:.0f}s)")
            for spec in pending:
                with _Method(model, tok, spec, recipe, engine, chunk) as m:
                    cache = m.cache(ids, prefill)
                    try:
                        rows = max(1, min(max_rows, row_memory // max(_cache_bytes(cache), 1)))
                        asked = [q for q in c.questions if not log.has(key(spec, c, q))]
                        for group in _batches(asked, [_question_ids(tok, q) for q in asked], rows):
                            q_ids = torch.tensor([t for _, t in group], device=device)
                            texts = m.answer(cache, q_ids, [q.max_new_tokens for q, _ in group])
                            for (q, _), text in zip(group, texts):
                                log.add(Answer(name, label(spec), engine, q.task, c.length, c.sample, c.seed,
                                               ids.shape[1] + q_ids.shape[1], score_answer(text, q.answers), text,
                                               q.answers, q.item, question_digest(c, q), spec.name,
                                               digest if needs_recipe(spec) else "", dtype))
                            bar.update(len(group))
                    finally:
                        m.close(cache)
            del prefill
            if stored is not None:
                stored.unlink(missing_ok=True)  # every method has answered this context
    finally:
        bar.close()
    wanted = {key(s, c, q) for c in contexts for s in specs for q in c.questions}
    return [a for a in log.answers if a.key in wanted]


# ---------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Score:
    """Mean score (0-100) of one method on one task (or "average": the mean of its tasks) at one length."""

    model: str
    method: str
    engine: str
    task: str
    length: int
    samples: int
    score: float
    ci95: tuple[float, float] | None = None  # "average" rows: over samples (`cluster_interval`)


def summarize(answers: Sequence[Answer]) -> list[Score]:
    """Task rows (mean over samples) and an "average" row per (model, method, engine, length).

    The average is the mean over samples of each sample's average (the mean of its task means, every task
    counting once however many questions it asks), and its interval is over samples (`cluster_interval`), so
    that the interval is about the number it is shown with, also where a sample lacks a task.
    """
    groups: dict[tuple, list[Answer]] = {}
    for a in answers:
        groups.setdefault((a.model, a.method, a.engine, a.length), []).append(a)
    out = []
    for (model, method, engine, length), rows in groups.items():
        tasks = [t for t in TASKS if any(a.task == t for a in rows)]
        task_means = {}
        for t in tasks:
            s = [a.score for a in rows if a.task == t]
            task_means[t] = 100 * sum(s) / len(s)
            out.append(Score(model, method, engine, t, length, len({a.sample for a in rows if a.task == t}),
                             round(task_means[t], 2)))
        samples = sorted({a.sample for a in rows})
        per_sample = []
        for s in samples:
            means = []
            for t in tasks:
                got = [a.score for a in rows if a.sample == s and a.task == t]
                if got:
                    means.append(100 * sum(got) / len(got))
            per_sample.append(sum(means) / len(means))
        ci = cluster_interval(per_sample, [1] * len(per_sample), 0.0, 100.0)
        avg = sum(per_sample) / len(per_sample)
        out.append(Score(model, method, engine, "average", length, len(samples), round(avg, 2),
                         None if ci is None else (round(ci[0], 2), round(ci[1], 2))))
    return out


@dataclass(frozen=True)
class Paired:
    """A method against the reference on the very same questions: the mean score difference in points, its 95%
    interval over samples (the questions of one sample's contexts share their prefills and quantized caches, so
    they are not independent draws; None with fewer than two samples), the method's share of the reference's
    mean score, and its mean score (0-100) on the questions the reference answers fully (so the reference's own
    failures do not blur it)."""

    model: str
    method: str
    engine: str
    length: int
    questions: int
    diff: float
    ci95: tuple[float, float] | None
    share: float | None
    score: float = math.nan  # the method's mean score (0-100) on these questions
    reference_score: float = math.nan
    on_reference_right: float | None = None  # mean score (0-100) where the reference scores 1
    reference_right: int = 0  # how many such questions
    contexts: int = 0  # the contexts (prefills) the questions were asked on
    samples: int = 0  # the samples (each length's contexts of one seed): what the interval is over


def paired(answers: Sequence[Answer], reference: str = "fp16", by_length: bool = True) -> list[Paired]:
    """Each method's answers against the reference's to the same questions, per (model, engine, length); with
    `by_length` False, the questions of every length pooled (their rows' `length` is 0).

    The interval is over samples (`cluster_interval`): a sample is one length's contexts of one seed (in layout
    `many` a needles context of 24 questions and a words context of 2), whose questions go together. Sampling
    contexts instead would let a draw hold only the 2-question word contexts; with two or three samples a
    percentile bootstrap would be narrower than their spread. `samples` and `contexts` say how many."""
    ref = {a.question: a.score for a in answers if a.method == reference}
    groups: dict[tuple, list[tuple[tuple, float, float]]] = {}
    for a in answers:
        r = ref.get(a.question)
        if a.method != reference and r is not None:
            groups.setdefault((a.model, a.method, a.engine, a.length if by_length else 0), []).append(
                (a.question, a.score, r))
    out = []
    for (model, method, engine, length), questions in groups.items():
        questions = sorted(questions)  # in the questions' order, not the answers file's
        pairs = [(x, y) for _, x, y in questions]
        n = len(pairs)
        diffs = [100 * (x - y) for x, y in pairs]
        samples: dict[tuple, list[float]] = {}
        for (q, x, y) in questions:  # q = (model, engine, length, task, sample, seed, item)
            samples.setdefault((q[2], q[4]), []).append(100 * (x - y))
        contexts = len({(q[2], q[4], q[5]) for q, _, _ in questions})
        ci = cluster_interval([sum(d) for d in samples.values()], [len(d) for d in samples.values()], -100.0, 100.0)
        mean, ref_mean = sum(x for x, _ in pairs) / n, sum(y for _, y in pairs) / n
        right = [x for x, y in pairs if y == 1.0]
        out.append(Paired(model, method, engine, length, n, round(sum(diffs) / n, 2),
                          None if ci is None else (round(ci[0], 2), round(ci[1], 2)),
                          round(mean / ref_mean, 3) if ref_mean > 0 else None, round(100 * mean, 2),
                          round(100 * ref_mean, 2), round(100 * sum(right) / len(right), 2) if right else None,
                          len(right), contexts, len(samples)))
    return out


def format_ruler_table(scores: Sequence[Score], task: str = "average") -> str:
    """Rows = methods, columns = lengths, cells = the task's score (with the share of fp16's where it is known)."""
    rows = [s for s in scores if s.task == task]
    if not rows:
        return f"RULER-style suite: no {task} scores"
    lengths = sorted({s.length for s in rows})
    methods = list(dict.fromkeys(s.method for s in rows))
    cell = {(s.method, s.length): s for s in rows}
    body = []
    for m in methods:
        line = [m]
        for n in lengths:
            s = cell.get((m, n))
            ref = cell.get(("fp16", n))
            if s is None:
                line.append("-")
            elif ref is not None and m != "fp16" and ref.score > 0:
                line.append(f"{s.score:.1f} ({100 * s.score / ref.score:.0f}%)")
            else:
                line.append(f"{s.score:.1f}")
        body.append(line)
    samples = sorted({s.samples for s in rows})
    title = (f"RULER-style {task} score (0-100; in brackets: share of fp16), "
             f"{'/'.join(map(str, samples))} sample(s) per length")
    return text_table(["method", *map(str, lengths)], body, title=title)
