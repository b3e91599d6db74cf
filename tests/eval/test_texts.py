"""The bundled texts of several kinds and their mix: disjoint calibration and evaluation parts, clean text, and
a mix whose calibration windows come from each of its texts in equal shares."""

from __future__ import annotations

import hashlib

import pytest
import torch

from kvsqueeze.eval.texts import (CORPORA, MIX, TEXTS, TextError, calibration_windows, evaluation_windows,
                                  load_text)


@pytest.fixture(scope="module")
def texts():
    return {name: load_text(name) for name in TEXTS}


@pytest.mark.parametrize("name", list(CORPORA))
def test_each_text_holds_pieces_out_for_evaluation(texts, name):
    text = texts[name]
    assert text.name == name and text.version.startswith(CORPORA[name][1] + "==")
    ev = text.evaluation_pieces
    assert text.calibration_pieces and ev and not text.calibration_pieces & set(ev)
    share = len(ev) / (len(ev) + len(text.calibration_pieces))
    assert 0.1 < share < 0.35, f"{name}: {share:.2f} of the pieces held out"
    assert len(text.evaluation) > 200_000, f"{name} holds too little evaluation text for 8 windows of 2,048 tokens"
    # every piece read lands on exactly one side, its text where that side says
    pieces = [body for _, body in CORPORA[name][0]() if body]
    for body in pieces:
        digest = hashlib.sha1(body.encode()).hexdigest()[:12]
        assert (digest in text.calibration_pieces) != (digest in ev)
        assert body in (text.evaluation if digest in ev else text.calibration)
    starts = dict(zip(ev, (s for s, _ in text.sources)))
    for body in pieces[:50]:
        digest = hashlib.sha1(body.encode()).hexdigest()[:12]
        if digest in starts:
            assert text.evaluation[starts[digest]:].startswith(body)


def test_texts_are_clean_of_markup(texts):
    code, facts, plays, es = (texts[n] for n in ("code", "facts", "plays", "es"))
    assert "def " in code.evaluation and '"""' in code.evaluation
    labels = [label for label, _ in CORPORA["code"][0]()]
    assert len(labels) > 200 and not [n for n in labels if "/tests/" in n or n.endswith("conftest.py")]
    assert not any(tag in facts.calibration for tag in ("<strong>", "<br", "&nbsp;", "&amp;"))
    assert "Geography - Location: " in facts.evaluation
    assert "**" not in plays.calibration and "###" not in plays.calibration
    assert "señorías" in es.calibration + es.evaluation


def test_mix_calibrates_on_equal_shares_of_its_texts(texts, tokenizer):
    mix = texts["mix"]
    assert tuple(p.name for p in mix.parts) == MIX and "plays" not in MIX
    assert mix.calibration_pieces == frozenset().union(*(texts[n].calibration_pieces for n in MIX))
    short = {n: texts[n].calibration[:60_000] for n in MIX}  # the byte tokenizer: keep it quick
    parts = tuple(type(mix)(n, short[n], "") for n in MIX)
    small = type(mix)("mix", "", "", parts=parts)
    windows = calibration_windows(tokenizer, small, 10, 256)
    assert windows.shape == (10, 256)
    at = 0
    for i, name in enumerate(MIX):  # 3, 3, 2, 2: the first parts take the remainder
        k = 3 if i < 2 else 2
        assert torch.equal(windows[at:at + k], calibration_windows(tokenizer, short[name], k, 256))
        at += k
    with pytest.raises(TextError, match=r"mixes 4 texts .*at least 4 windows"):
        calibration_windows(tokenizer, small, 3, 256)


def test_mix_evaluation_windows_name_their_text(texts, tokenizer):
    mix = texts["mix"]
    starts = [s for s, _ in mix.sources]
    assert starts == sorted(starts) and all(name.split(":")[0] in MIX for _, name in mix.sources)
    for start, name in mix.sources[::97]:  # each source points at the start of its piece in the joined text
        part, piece = name.split(":", 1)
        own = texts[part]
        own_start = dict((n, s) for s, n in own.sources)[piece]
        assert mix.evaluation[start:start + 200] == own.evaluation[own_start:own_start + 200]
    ew = evaluation_windows(tokenizer, type(mix)("mix", "", mix.evaluation[:400_000], mix.sources), 512, 4)
    assert all(src and all(":" in s for s in src) for src in ew.sources)
    assert ew.ids.shape == (4, 512)


def test_unknown_text_names_the_choices():
    with pytest.raises(TextError, match=r"bbc, code, facts, plays, es, mix"):
        load_text("wikipedia")
    from kvsqueeze.cli import TEXT_NAMES

    assert TEXT_NAMES == ", ".join(TEXTS)  # what --help lists is what load_text reads


def _sides(path) -> tuple[str, str]:
    from kvsqueeze.eval.texts import load_text

    text = load_text(str(path))
    return text.calibration, text.evaluation


def test_a_windows_file_keeps_each_paragraph_on_one_side(tmp_path):
    """CRLF line ends (and blank lines holding spaces) once hid every paragraph break, so a file was split by
    line and a paragraph's lines landed on both sides."""
    paragraphs = [f"Paragraph {i} first sentence.\nParagraph {i} second sentence." for i in range(30)]
    for name, sep, end in (("crlf.txt", "\r\n\r\n", "\r\n"), ("spaces.txt", "\n  \n", "\n")):
        path = tmp_path / name
        path.write_bytes(sep.join(p.replace("\n", end) for p in paragraphs).encode())
        cal, ev = _sides(path)
        assert cal and ev
        for i in range(30):
            first, second = f"Paragraph {i} first", f"Paragraph {i} second"
            assert (first in cal) == (second in cal) and (first in ev) == (second in ev), (name, i)


def test_a_short_file_with_a_repeated_line_shares_no_text_between_its_parts(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("line number 0\nline number 1\nline number 2\nline number 3\nline number 0\n")
    cal, ev = _sides(path)
    assert cal and ev and not set(ev.split("\n\n")) & set(cal.split("\n\n"))


def test_long_blocks_are_cut_so_both_parts_hold_text(tmp_path):
    """One long line without spaces (CJK, minified code) was refused as too short, and a title over one long line
    could leave a part of a few characters."""
    cjk = tmp_path / "cjk.txt"
    cjk.write_text("".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(22_000)))  # no spaces, no repeats
    cal, ev = _sides(cjk)
    assert len(cal) > 10_000 and len(ev) > 1_000
    titled = tmp_path / "titled.txt"
    titled.write_text("A title\n" + " ".join(f"word{i}" for i in range(40_000)))
    cal, ev = _sides(titled)
    assert min(len(cal), len(ev)) > 0.05 * (len(cal) + len(ev))
