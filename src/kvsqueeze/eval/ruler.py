"""A RULER-style long-context suite, generated locally: tasks, seeded contexts, scorers.

RULER (Hsieh et al., arXiv 2404.06654) measures what a model can still find,
follow and count at a given context length; KVQuant (arXiv 2401.18079) reports
it to 32K tokens. No dataset hub is needed here: every context is built from a
haystack text (by default the held-out part of the BBC corpus) and a seed.

Tasks (`TASKS`), scored like RULER (`score_answer`: the share of the expected
strings found in the answer, case-insensitive):

* ``niah_single_number`` / ``niah_single_word`` / ``niah_single_uuid``: one
  needle "One of the special magic numbers for KEY is: VALUE." per key;
* ``niah_multikey``: the asked key has three distractor needles whose keys
  share its first word;
* ``niah_multivalue``: one key with four values, all to be listed;
* ``niah_multiquery``: two keys asked at once;
* ``vt``: variable tracking, a chain of five assignments ``VAR X = 12345.``,
  ``VAR Y = VAR X.``, ...; every variable holding the value is to be named;
* ``cwe``: common-words extraction, the ten most common words of a long
  numbered word list; ``fwe``: the three most frequent words of that list.

Prefills are the cost of long contexts, so a context can serve several
questions. Layout ``shared``: one ``needles`` context carries the needles of
all six NIAH tasks and the variable chain at seeded depths of the haystack
(every NIAH question thus faces needles of other keys, as RULER's multi-key
variants do: harder than RULER's single-needle tasks); ``separate``: each
needle task has its own context with its own needles only, as RULER builds
them (seven prefills where ``shared`` needs one); ``many``: one ``needles``
context asks several questions of each task (`MANY`, 24 in all), each with
needles of its own among the others', so that one prefill yields dozens of
paired questions. In all three, a ``words`` context carries the list for
``cwe`` and ``fwe``.

The module does not import transformers: prompt building takes any
tokenizer-like object (`passkey._token_ids`).
"""

from __future__ import annotations

import hashlib
import random
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from .fitting import largest_fitting
from .passkey import _token_ids

__all__ = [
    "TASKS",
    "Context",
    "Question",
    "RulerError",
    "build_contexts",
    "score_answer",
    "question_digest",
    "word_pool",
]

NEEDLE_TASKS = ("niah_single_number", "niah_single_word", "niah_single_uuid", "niah_multikey",
                "niah_multivalue", "niah_multiquery", "vt")
WORD_TASKS = ("cwe", "fwe")
TASKS = NEEDLE_TASKS + WORD_TASKS
LAYOUTS = ("shared", "separate", "many")
# Layout "many": the questions of one `needles` context, per task (each with needles of its own), 24 in all;
# with the `words` context's two, 26 paired questions a sample
MANY = {"niah_single_number": 5, "niah_single_word": 5, "niah_single_uuid": 3, "niah_multikey": 4,
        "niah_multivalue": 2, "niah_multiquery": 2, "vt": 3}

NEEDLES_INTRO = ("Some special magic numbers, words and uuids, and a chain of variable assignments, are hidden "
                 "within the following text. Make sure to memorize them. I will quiz you about them afterwards.")
WORDS_INTRO = ("Below is a numbered list of words. In these words, some appear more often than others. "
               "Memorize the ones that appear most often.")

COMMON_WORDS = 10  # cwe asks for these; the first FREQUENT_WORDS of them are fwe's answer
FREQUENT_WORDS = 3
FREQUENT_COUNTS = (48, 42, 36)  # occurrences of the three most frequent words
COMMON_COUNT = 30  # the other seven common words (RULER's cwe: 30)
RARE_COUNT = 3  # every other word of the list (RULER's cwe: 3)
VT_CHAIN = 5  # variables in the chain (RULER's vt: one chain, four hops)


class RulerError(ValueError):
    """A length, task or haystack the suite cannot build from."""


@dataclass(frozen=True)
class Question:
    """One question on a context: `text` follows the context (it ends with the answer's opening words)."""

    task: str
    text: str
    answers: tuple[str, ...]  # every one of them should appear in the answer
    max_new_tokens: int
    item: int = 0  # which of the context's questions of this task (layout "many" asks several)


@dataclass(frozen=True)
class Context:
    """One long context and the questions asked on it."""

    kind: str  # "needles" (shared layout), a needle task's name (separate layout), or "words"
    length: int  # the requested sequence length: context + question + answer fit in it
    sample: int
    seed: int
    text: str
    n_tokens: int
    questions: tuple[Question, ...]


def question_digest(context: Context, question: Question) -> str:
    """What identifies a question across runs: a digest of its context's text and its own (the haystack, the task
    set, the layout and the tokenizer all shape them), beside the seed and sample that built them."""
    return hashlib.sha256((context.text + "\x00" + question.text).encode()).hexdigest()[:16]


def score_answer(answer: str, expected: Sequence[str]) -> float:
    """RULER's string_match_all: the share of `expected` strings that occur in `answer` (case-insensitive)."""
    if not expected:
        raise ValueError("a question needs at least one expected string")
    low = answer.lower()
    return sum(e.lower() in low for e in expected) / len(expected)


_WORD = re.compile(r"\b[a-z]{4,10}\b")
_SENTENCE = re.compile(r"(?<=[.!?])\s+")


def word_pool(text: str, minimum: int = 400) -> list[str]:
    """The distinct lower-case words (4 to 10 letters) of `text`, in order of first appearance."""
    pool = list(dict.fromkeys(_WORD.findall(text)))
    if len(pool) < minimum:
        raise RulerError(f"the haystack text has {len(pool)} distinct words of 4-10 letters; the suite needs "
                         f"{minimum}: give a longer text")
    return pool


def derive_seed(seed: int, *parts) -> int:
    """A 64-bit seed from `seed` and the parts (a context's kind, length, sample; a cell's method ...)."""
    digest = hashlib.sha256(":".join(map(str, (seed, *parts))).encode()).digest()
    return int.from_bytes(digest[:8], "big")


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _var_name(rng: random.Random, taken: set[str]) -> str:
    while True:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in taken:
            taken.add(name)
            return name


def _needle(kind: str, key: str, value: str) -> str:
    return f"One of the special magic {kind} for {key} is: {value}."


def _ask(kind: str, keys: str, plural: bool) -> str:
    are = "are" if plural else "is"
    what = f"all the special magic {kind}" if plural else f"the special magic {kind[:-1]}"
    return (f"What {are} {what} for {keys} mentioned in the provided text? "
            f"The special magic {kind if plural else kind[:-1]} for {keys} mentioned in the provided text {are}")


def _needles_plan(rng: random.Random, pool: list[str], tasks: set[str]):
    """The inserted sentences and the questions of one `needles` context."""
    words = rng.sample(pool, 40)
    keys = iter(f"{a}-{b}" for a, b in zip(words[0:20:2], words[1:20:2]))
    values = iter(words[20:])
    inserts: list[tuple[float, str]] = []
    questions: list[Question] = []

    def add(task: str, sentences: list[str], question: str, answers: list[str], max_new: int) -> None:
        depths = sorted(rng.random() for _ in sentences)  # drawn for every task: a context does not depend on
        if task in tasks:                                 # which tasks are asked; a chain keeps its order
            inserts.extend(zip(depths, sentences))
            questions.append(Question(task, question, tuple(answers), max_new))

    k, v = next(keys), _number(rng)
    add("niah_single_number", [_needle("numbers", k, v)], _ask("numbers", k, False), [v], 12)
    k, v = next(keys), next(values)
    add("niah_single_word", [_needle("words", k, v)], _ask("words", k, False), [v], 8)
    k, v = next(keys), str(uuid.UUID(int=rng.getrandbits(128), version=4))
    add("niah_single_uuid", [_needle("uuids", k, v)], _ask("uuids", k, False), [v], 48)
    first = next(keys).split("-")[0]
    rivals = [f"{first}-{w}" for w in rng.sample(words[20:], 4)]
    nums = [_number(rng) for _ in rivals]
    add("niah_multikey", [_needle("numbers", r, n) for r, n in zip(rivals, nums)],
        _ask("numbers", rivals[0], False), [nums[0]], 12)
    k = next(keys)
    nums = [_number(rng) for _ in range(4)]
    add("niah_multivalue", [_needle("numbers", k, n) for n in nums], _ask("numbers", k, True), nums, 48)
    ka, kb = next(keys), next(keys)
    na, nb = _number(rng), _number(rng)
    add("niah_multiquery", [_needle("numbers", ka, na), _needle("numbers", kb, nb)],
        _ask("numbers", f"{ka} and {kb}", True), [na, nb], 28)
    names: list[str] = []
    taken: set[str] = set()
    value = str(rng.randint(10_000, 99_999))
    chain = []
    for i in range(VT_CHAIN):
        names.append(_var_name(rng, taken))
        chain.append(f"VAR {names[-1]} = {value if i == 0 else 'VAR ' + names[-2]}.")
    add("vt", chain,
        f"Question: Find all variables that are assigned the value {value} in the text above. Answer: According "
        f"to the chain of variable assignments in the text above, {VT_CHAIN} variables are assigned the value "
        f"{value}, they are:", names, 48)
    return sorted(inserts, key=lambda x: x[0]), questions


def _many_plan(rng: random.Random, pool: list[str], tasks: set[str]):
    """The inserted sentences and the questions of one `needles` context of layout "many": `MANY[task]`
    questions of each task asked, each with needles of its own (every key distinct), all at seeded depths."""
    words = rng.sample(pool, 160)
    firsts, seconds = iter(words[:80]), iter(words[80:])
    used: set[str] = set()

    def key(first: str | None = None) -> str:
        k = f"{first or next(firsts)}-{next(seconds)}"
        used.add(k)
        return k

    value_words = [w for w in pool if w not in set(words)]
    values = iter(rng.sample(value_words, 16))
    inserts: list[tuple[float, str]] = []
    questions: list[Question] = []
    taken: set[str] = set()
    for task, copies in MANY.items():
        for item in range(copies):
            if task == "niah_single_number":
                k, v = key(), _number(rng)
                sentences, question, answers, max_new = [_needle("numbers", k, v)], _ask("numbers", k, False), [v], 12
            elif task == "niah_single_word":
                k, v = key(), next(values)
                sentences, question, answers, max_new = [_needle("words", k, v)], _ask("words", k, False), [v], 8
            elif task == "niah_single_uuid":
                k, v = key(), str(uuid.UUID(int=rng.getrandbits(128), version=4))
                sentences, question, answers, max_new = [_needle("uuids", k, v)], _ask("uuids", k, False), [v], 48
            elif task == "niah_multikey":
                first = next(firsts)
                rivals = [key(first) for _ in range(4)]
                nums = [_number(rng) for _ in rivals]
                sentences = [_needle("numbers", r, n) for r, n in zip(rivals, nums)]
                question, answers, max_new = _ask("numbers", rivals[0], False), [nums[0]], 12
            elif task == "niah_multivalue":
                k = key()
                answers = [_number(rng) for _ in range(4)]
                sentences, question, max_new = [_needle("numbers", k, n) for n in answers], _ask("numbers", k, True), 48
            elif task == "niah_multiquery":
                ka, kb = key(), key()
                answers = [_number(rng), _number(rng)]
                sentences = [_needle("numbers", ka, answers[0]), _needle("numbers", kb, answers[1])]
                question, max_new = _ask("numbers", f"{ka} and {kb}", True), 28
            else:  # vt: a chain of its own, its own value
                value = str(rng.randint(10_000, 99_999))
                answers, sentences = [], []
                for i in range(VT_CHAIN):
                    answers.append(_var_name(rng, taken))
                    sentences.append(f"VAR {answers[-1]} = {value if i == 0 else 'VAR ' + answers[-2]}.")
                question = (f"Question: Find all variables that are assigned the value {value} in the text above. "
                            f"Answer: According to the chain of variable assignments in the text above, {VT_CHAIN} "
                            f"variables are assigned the value {value}, they are:")
                max_new = 48
            depths = sorted(rng.random() for _ in sentences)  # a chain keeps its order
            if task in tasks:
                inserts.extend(zip(depths, sentences))
                questions.append(Question(task, question, tuple(answers), max_new, item))
    return sorted(inserts, key=lambda x: x[0]), questions


COMMON_SHARE = 0.35  # at most this share of a list's items are common words (RULER's counts: ~1/3 at 4K tokens)


def _word_counts(items: float) -> list[int]:
    """Occurrences of the common words, most frequent first, in a list of about `items` items: RULER's counts
    where they take at most COMMON_SHARE of it, fewer in shorter lists, always above RARE_COUNT, same order."""
    counts = list(FREQUENT_COUNTS) + [COMMON_COUNT] * (COMMON_WORDS - FREQUENT_WORDS)
    scale = min(1.0, COMMON_SHARE * items / sum(counts))
    floors = [RARE_COUNT + 1 + FREQUENT_WORDS - i for i in range(FREQUENT_WORDS)]
    floors += [RARE_COUNT + 1] * (COMMON_WORDS - FREQUENT_WORDS)
    return [max(f, round(c * scale)) for c, f in zip(counts, floors)]


def _words_plan(rng: random.Random, pool: list[str], tasks: set[str], items: float):
    chosen = rng.sample(pool, COMMON_WORDS)
    rare = [w for w in pool if w not in set(chosen)]
    rng.shuffle(rare)
    questions = []
    if "cwe" in tasks:
        questions.append(Question(
            "cwe", f"Question: What are the {COMMON_WORDS} most common words in the above list? Answer: The top "
            f"{COMMON_WORDS} words that appear most often in the list are:", tuple(chosen), 64))
    if "fwe" in tasks:
        questions.append(Question(
            "fwe", f"Question: What are the {FREQUENT_WORDS} most frequently appearing words in the above list? "
            f"Answer: The {FREQUENT_WORDS} most frequently appearing words in the list are:",
            tuple(chosen[:FREQUENT_WORDS]), 24))
    return chosen, _word_counts(items), rare, questions


def _fit(build, count, length: int, reserve: int, what: str) -> tuple[int, str, int]:
    """The largest n whose text `build(n)` takes at most `length - reserve` tokens (`count` tokenizes):
    (n, text, tokens)."""
    length -= reserve
    memo: dict[int, tuple[str, int]] = {}

    def f(n: int) -> int:
        if n not in memo:
            text = build(n)
            memo[n] = (text, count(text))
        return memo[n][1]

    if f(0) > length:
        raise RulerError(f"length {length + reserve} is too short for a {what} context: its fixed parts and "
                         f"its longest question and answer alone take {f(0) + reserve} tokens; use lengths of at "
                         f"least {f(0) + reserve + 64}")
    try:
        lo = largest_fitting(f, length)
    except ValueError as e:
        raise RulerError(str(e)) from None
    text, n_tokens = memo[lo] if lo in memo else (build(lo), f(lo))
    return lo, text, n_tokens


def build_contexts(tokenizer, haystack: str, length: int, samples: int, seed: int = 0,
                   tasks: Sequence[str] = TASKS, layout: str = "shared") -> list[Context]:
    """`samples` contexts of each kind the `tasks` need, every one fitting `length` tokens with its questions.

    `layout` "shared": the needle tasks share one `needles` context per sample (fewer, costlier prefills);
    "separate": each needle task has a context of its own holding its needles alone (kind = the task; as
    RULER builds them). Contexts derive from (seed, kind, length, sample) alone, so every method and engine
    sees the same ones.

    Raises:
        RulerError: an unknown task, a length too short for the fixed parts, or too short a haystack.
    """
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise RulerError(f"unknown task(s) {', '.join(unknown)}; the suite has {', '.join(TASKS)}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise RulerError(f"samples must be an int >= 1, got {samples!r}")
    if layout not in LAYOUTS:
        raise RulerError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    wanted = set(tasks)
    needle_groups = [t for t in NEEDLE_TASKS if t in wanted]
    if layout in ("shared", "many"):
        needle_groups = [("needles", set(needle_groups))] if needle_groups else []
    else:
        needle_groups = [(t, {t}) for t in needle_groups]
    sentences = [s for s in _SENTENCE.split(haystack) if s.strip()]
    if len(sentences) < 50:
        raise RulerError(f"the haystack text has {len(sentences)} sentences; give a longer text")
    pool = word_pool(haystack)

    def count(text: str) -> int:
        return len(_token_ids(tokenizer, text))

    def reserve(questions) -> int:  # the longest question with its whole answer (questions follow a newline)
        return max(len(_token_ids(tokenizer, "\n" + q.text)) + q.max_new_tokens for q in questions)

    out = []
    for sample in range(samples):
        for kind, group in needle_groups:
            s = derive_seed(seed, kind if layout != "many" else "many", length, sample)
            rng = random.Random(s)
            plan, questions = (_many_plan if layout == "many" else _needles_plan)(rng, pool, group)
            start = rng.randrange(len(sentences))

            def needles(n: int, plan=plan, start=start) -> str:
                body = [sentences[(start + i) % len(sentences)] for i in range(n)]
                for depth, sentence in reversed(plan):  # deepest first, so earlier indices stay put
                    body.insert(int(depth * n + 0.5), sentence)
                return NEEDLES_INTRO + "\n" + " ".join(body)

            _, text, n_tok = _fit(needles, count, length, reserve(questions), kind)
            out.append(Context(kind, length, sample, s, text, n_tok, tuple(questions)))
        if wanted & set(WORD_TASKS):
            s = derive_seed(seed, "words", length, sample)
            rng = random.Random(s)
            probe = " ".join(f"{i + 1000}. {w}" for i, w in enumerate(pool[:64]))  # tokens of one list item
            items = length / max(1e-9, count(probe) / 64)
            chosen, counts, rare, questions = _words_plan(rng, pool, wanted, items)
            order_seed = rng.getrandbits(64)

            def words(n: int, chosen=chosen, counts=counts, rare=rare, order_seed=order_seed) -> str:
                # n rare words (cycling through the pool's other words) RARE_COUNT times each, and the common ones
                items = [w for w, c in zip(chosen, counts) for _ in range(c)]
                items += [rare[i % len(rare)] for i in range(n) for _ in range(RARE_COUNT)]
                random.Random(order_seed).shuffle(items)
                return WORDS_INTRO + "\n" + " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))

            n, text, n_tok = _fit(words, count, length, reserve(questions), "words")
            if n > len(rare):
                raise RulerError(f"a {length}-token word list needs {n} distinct rare words and the haystack has "
                                 f"{len(rare)}: give a text with more distinct words")
            out.append(Context("words", length, sample, s, text, n_tok, tuple(questions)))
    return out
