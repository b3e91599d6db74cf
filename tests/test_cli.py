"""`kvsqueeze generate`: greedy text through the compressed cache plus its memory report; errors exit 2."""

from __future__ import annotations

import shutil

import pytest

from kvsqueeze.cli import main


def test_generate_prints_text_and_memory_report(tiny_model_dir, tiny_recipe_dir, capsys):
    rc = main(["generate", "--model", str(tiny_model_dir), "--recipe", str(tiny_recipe_dir),
               "--method", "nuq3-1%", "--prompt", "the cache key", "--max-new-tokens", "12"])
    assert rc == 0
    out = capsys.readouterr().out
    assert out.startswith("the cache key")
    assert "KV cache nuq3-1%: 2 layers, batch 1" in out and "fp16 cache" in out and "outlier_values" in out


@pytest.fixture(scope="module")
def long_model_dir(tiny_llama, tokenizer, tmp_path_factory):
    """The tiny LLaMA's weights with a context of 4,096 positions (past the presets' default 2,048)."""
    d = tmp_path_factory.mktemp("long-model")
    tiny_llama.config.max_position_embeddings = 4096
    try:
        tiny_llama.save_pretrained(d)
    finally:
        tiny_llama.config.max_position_embeddings = 1024
    tokenizer.save_pretrained(d)
    return d


def test_generate_spends_a_preset_s_bits_at_the_length_it_reaches(long_model_dir, tiny_recipe_dir, capsys):
    """A preset named without ':ctxN' is chosen for the prompt and the new tokens, never for fewer than 2,048: its
    window is paid for at the length the cache reaches, so the cache holds the preset's bits there."""
    d = long_model_dir
    prompt = "the cache key " * 284  # 3,976 byte tokens
    held = {}
    for method in ("q3.5", "q3.5:ctx2048"):
        assert main(["generate", "--model", str(d), "--recipe", str(tiny_recipe_dir), "--prompt", prompt,
                     "--max-new-tokens", "4", "--decode", "dense", "--method", method]) == 0
        out = capsys.readouterr().out
        head = next(line for line in out.splitlines() if line.startswith("KV cache "))
        held[method] = (head.split(":")[:-1], float(out.split(" bits/element")[0].rsplit(" ", 1)[-1]))
    assert held["q3.5"][0] == ["KV cache nuq@3.5", "r32", "chan", "ctx3980"]  # 3,976 + 4 tokens
    assert held["q3.5:ctx2048"][0] == ["KV cache nuq@3.5", "r32", "chan"]
    # at 3,979 cached tokens (the last new token is not cached) the longer context's choice spends what the
    # window leaves: more bits than the 2,048-token choice, and no more than the preset's 3.5 at 3,980
    assert held["q3.5:ctx2048"][1] < held["q3.5"][1] <= 3.5 * 3980 / 3979 + 1e-3, held


def test_eval_chooses_a_preset_for_each_window_length(long_model_dir, tiny_recipe_dir, tmp_path):
    """`eval --seqlen` runs a preset chosen for each window length (at least 2,048): the cache holds its bits at
    that length, where the 2,048-token choice would hold fewer."""
    import json

    from conftest import sample_text

    text = tmp_path / "long.txt"
    text.write_text("\n\n".join(sample_text(60, seed=i) for i in range(200)))  # 200 paragraphs, a fifth held out
    rows = {}
    for method in ("q3.5", "q3.5:ctx2048"):
        out = tmp_path / f"{method}.json"
        assert main(["eval", "--model", str(long_model_dir), "--recipe", str(tiny_recipe_dir), "--text", str(text),
                     "--methods", f"fp16,{method}", "--seqlen", "3000", "--max-windows", "1",
                     "--json", str(out)]) == 0
        rows.update({r["method"]: r for r in json.loads(out.read_text())["rows"]})
    assert set(rows) == {"fp16", "nuq@3.5:r32:chan:ctx3000", "nuq@3.5:r32:chan"}
    assert rows["nuq@3.5:r32:chan"]["avg_bits"] < rows["nuq@3.5:r32:chan:ctx3000"]["avg_bits"] <= 3.5 + 1e-3


def test_generate_fp16_needs_no_recipe(tiny_model_dir, capsys):
    assert main(["generate", "--model", str(tiny_model_dir), "--method", "fp16", "--prompt", "hello",
                 "--max-new-tokens", "3"]) == 0
    assert "KV cache fp16" in capsys.readouterr().out


@pytest.mark.parametrize("argv, match", [
    (["--method", "kivi2"], "Supported: fp16"),
    (["--method", "nuq3-1%"], "pass --recipe"),
    (["--method", "nuq9"], "bit width 9"),
])
def test_generate_errors_exit_2(tiny_model_dir, capsys, argv, match):
    rc = main(["generate", "--model", str(tiny_model_dir), "--prompt", "hi", *argv])
    assert rc == 2
    assert match in capsys.readouterr().err


def test_generate_recipe_of_another_model(tiny_mistral, tiny_model_dir, tmp_path, capsys):
    from kvsqueeze.calibrate.collect import collect
    from kvsqueeze.calibrate.fit import CalibrationConfig, fit_recipe
    from conftest import random_ids

    cfg = CalibrationConfig(samples=1, seqlen=32, bits=(3,), fractions=(0.0, 0.01))
    acts = collect(tiny_mistral, random_ids(1, 32, seed=1), sinks=1, progress=False)
    fit_recipe(tiny_mistral, acts, cfg, "tiny-mistral", "random", progress=False).save(tmp_path / "r")
    rc = main(["generate", "--model", str(tiny_model_dir), "--recipe", str(tmp_path / "r"), "--prompt", "hi"])
    assert rc == 2
    assert "calibrated on model 'tiny-mistral'" in capsys.readouterr().err


def test_generate_fused_and_dense_decode_print_the_same(tiny_model_dir, tiny_recipe_dir, capsys):
    outs = []
    for decode in ("auto", "dense"):
        assert main(["generate", "--model", str(tiny_model_dir), "--recipe", str(tiny_recipe_dir),
                     "--method", "nuq3-1%", "--prompt", "the cache key", "--max-new-tokens", "16",
                     "--decode", decode]) == 0
        outs.append(capsys.readouterr().out.split("\n\nKV cache")[0])
    assert outs[0] == outs[1]


def test_command_defaults_are_the_config_defaults():
    """Every default of the command comes from kvsqueeze.config, so the CLI and the Python API cannot drift."""
    import dataclasses

    from kvsqueeze.cli import build_parser
    from kvsqueeze.config import (
        DEFAULT_MODEL,
        DEFAULT_TEXT,
        CalibrationConfig,
        EvalConfig,
        GenerateConfig,
        InspectConfig,
        MemoryConfig,
        PasskeyConfig,
    )

    p = build_parser()
    cal = p.parse_args(["calibrate", "--out", "x"])
    c = CalibrationConfig()
    assert (cal.model, cal.text, cal.samples, cal.seqlen, cal.sinks) == (DEFAULT_MODEL, DEFAULT_TEXT, c.samples,
                                                                         c.seqlen, c.sinks)
    assert cal.bits == ",".join(map(str, c.bits))
    assert cal.ablation == c.ablation and not c.ablation and c.fits == ("fs2",)
    assert sorted({0.0, *(float(x) / 100 for x in cal.outliers.split(","))}) == sorted(c.fractions)
    for command, config, extra in (("eval", EvalConfig(), []), ("passkey", PasskeyConfig(), []),
                                   ("generate", GenerateConfig(), ["--prompt", "x"]),
                                   ("inspect", InspectConfig(), ["--out", "x"])):
        args = p.parse_args([command, *extra])
        for f in dataclasses.fields(config):
            assert getattr(args, f.name) == getattr(config, f.name), (command, f.name)
    mem = p.parse_args(["memory"])
    m = MemoryConfig()
    assert (mem.model, mem.context, mem.methods, mem.batch, mem.gpus, mem.gpu_mem) == (
        m.model, m.contexts, m.methods, m.batch, m.gpus, m.gpu_mem)


def test_dtype_reaches_the_model_and_float16_calibration_runs_in_float32(tiny_model_dir, tiny_recipe_dir, text_file,
                                                                        tmp_path, capsys):
    import torch

    from kvsqueeze.integrations.loading import ModelLoadError, load_model
    from kvsqueeze.recipe import Recipe

    model, _ = load_model(str(tiny_model_dir), "bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ModelLoadError, match="not one of float32, bfloat16, float16"):
        load_model(str(tiny_model_dir), "int8")
    # a recipe calibrated in float32 serves the model loaded in bfloat16
    assert main(["generate", "--model", str(tiny_model_dir), "--recipe", str(tiny_recipe_dir), "--dtype", "bfloat16",
                 "--prompt", "the cache key", "--max-new-tokens", "6"]) == 0
    assert "KV cache nuq@3.5:r32:chan:" in capsys.readouterr().out  # the default method, the 3.5-bit preset q3.5
    # float16: Fisher information in float32 (float16 gradients would underflow to zero weights)
    args = ["calibrate", "--model", str(tiny_model_dir), "--text", str(text_file), "--samples", "2", "--seqlen", "64",
            "--bits", "3", "--outliers", "1"]
    assert main([*args, "--out", str(tmp_path / "fp16"), "--dtype", "float16"]) == 0
    assert main([*args, "--out", str(tmp_path / "fp32"), "--dtype", "float32"]) == 0
    half, full = Recipe.load(tmp_path / "fp16"), Recipe.load(tmp_path / "fp32")
    assert half.tensors.keys() == full.tensors.keys()
    for name, t in half.tensors.items():
        # the same statistics as the float32 model's, up to the float16 rounding of the activations
        assert torch.isfinite(t).all(), name
        torch.testing.assert_close(t.float(), full.tensors[name].float(), atol=5e-2, rtol=5e-2, msg=name)


def test_device_reaches_the_model_or_is_refused_with_the_reason(tiny_model_dir, tiny_recipe_dir, capsys):
    import torch

    from kvsqueeze.integrations.loading import load_model

    model, _ = load_model(str(tiny_model_dir), device="cpu")
    assert next(model.parameters()).device == torch.device("cpu")
    args = ["generate", "--model", str(tiny_model_dir), "--recipe", str(tiny_recipe_dir), "--prompt", "the cache",
            "--max-new-tokens", "2"]
    assert main([*args, "--device", "cpu"]) == 0
    capsys.readouterr()
    assert main([*args, "--device", "gpu0"]) == 2
    assert "not a torch device name" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main([*args, "--device", "cuda"]) == 2
        assert "sees no CUDA GPU; use --device cpu" in capsys.readouterr().err


def test_calibrate_stores_bit_budgets_that_eval_and_inspect_read(tiny_model_dir, text_file, tmp_path, capsys):
    from kvsqueeze.methods.budget import allocate, allocate_channels, recipe_allocation
    from kvsqueeze.recipe import Recipe

    out = tmp_path / "recipe"
    assert main(["calibrate", "--model", str(tiny_model_dir), "--text", str(text_file), "--samples", "2",
                 "--seqlen", "64", "--outliers", "1", "--out", str(out), "--avg-bits", "2.8,3.5"]) == 0
    assert "nuq@3.5:" in capsys.readouterr().out
    recipe = Recipe.load(out)
    assert set(recipe.meta["budgets"]) == {"2.8", "3.5", "2.8:chan", "3.5:chan"}  # a width per layer / channel
    assert recipe_allocation(recipe, 3.5) == allocate(recipe, 3.5)  # what was stored is the choice itself
    stored, now = recipe_allocation(recipe, 3.5, unit="channel"), allocate_channels(recipe, 3.5)
    assert (stored.keys, stored.values) == (now.keys, now.values)  # its float64 errors were saved as float32
    assert stored.predicted == pytest.approx(now.predicted, rel=1e-6)
    assert main(["eval", "--model", str(tiny_model_dir), "--text", str(text_file), "--recipe", str(out),
                 "--methods", "fp16,nuq@3.5", "--seqlen", "64", "--max-windows", "2"]) == 0
    assert "nuq@3.5" in capsys.readouterr().out
    assert main(["inspect", "--recipe", str(out), "--avg-bits", "3.5", "--out", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "budget_3.5.png").stat().st_size > 1000
    assert main(["inspect", "--recipe", str(out), "--avg-bits", "3.5", "--chan", "--out", str(tmp_path / "plots")]) == 0
    assert "nuq@3.5:chan" in capsys.readouterr().out
    assert (tmp_path / "plots" / "budget_3.5_chan.png").stat().st_size > 1000
    assert main(["eval", "--model", str(tiny_model_dir), "--text", str(text_file), "--recipe", str(out),
                 "--methods", "fp16,nuq@3.5:chan", "--seqlen", "64", "--max-windows", "2"]) == 0
    assert "nuq@3.5:chan" in capsys.readouterr().out
    assert main(["inspect", "--avg-bits", "3.5", "--out", str(tmp_path / "plots")]) == 2
    assert "pass --recipe" in capsys.readouterr().err
    # a recipe from before its fingerprint named each layer's window takes them from its model, checked first
    old = Recipe.load(out)
    del old.meta["model"]["fingerprint"]["layer_windows"]
    old.save(tmp_path / "old")
    from conftest import tiny_model

    shutil.copytree(tiny_model_dir, tmp_path / "other")  # its tokenizer; other weights of the same shape
    tiny_model("llama", seed=5).save_pretrained(tmp_path / "other")
    assert main(["inspect", "--model", str(tmp_path / "other"), "--recipe", str(tmp_path / "old"), "--avg-bits",
                 "3.5", "--out", str(tmp_path / "plots")]) == 2  # not the recipe's model
    assert "calibrated on model" in capsys.readouterr().err
    assert main(["inspect", "--model", str(tiny_model_dir), "--recipe", str(tmp_path / "old"), "--avg-bits", "3.5",
                 "--out", str(tmp_path / "plots")]) == 0
    # measured sensitivities: refused until `kvsqueeze budget` adds them, then read by ':kl:chan'
    assert main(["inspect", "--recipe", str(out), "--avg-bits", "3.5", "--kl", "--chan", "--out",
                 str(tmp_path / "plots")]) == 2
    assert "kvsqueeze budget" in capsys.readouterr().err
    assert main(["budget", "--model", str(tiny_model_dir), "--text", str(text_file), "--recipe", str(out),
                 "--windows", "1", "--seqlen", "48", "--outliers", "1"]) == 0
    assert "nuq@AVG:kl:chan" in capsys.readouterr().out
    assert main(["inspect", "--recipe", str(out), "--avg-bits", "3.5", "--kl", "--chan", "--out",
                 str(tmp_path / "plots")]) == 0
    assert "nuq@3.5:kl:chan" in capsys.readouterr().out
    assert (tmp_path / "plots" / "budget_3.5_kl_chan.png").stat().st_size > 1000
    assert main(["eval", "--model", str(tiny_model_dir), "--text", str(text_file), "--recipe", str(out),
                 "--methods", "fp16,nuq@3.5:kl:chan", "--seqlen", "64", "--max-windows", "2"]) == 0
    assert "nuq@3.5:kl:chan" in capsys.readouterr().out
    assert main(["calibrate", "--model", str(tiny_model_dir), "--out", str(tmp_path / "x"), "--avg-bits", "1"]) == 2
    assert "between 2 and 16" in capsys.readouterr().err


def test_calibrate_kl_measures_what_budget_measures(tiny_model_dir, text_file, tmp_path, capsys):
    """`calibrate --kl` is calibration then `kvsqueeze budget` in one command: the same sensitivities (the
    recipe's middle width, with and without its largest outlier fraction) and the ':kl' choices stored."""
    from kvsqueeze.methods.budget import allocate_channels, budget_key, sensitivity_key
    from kvsqueeze.recipe import Recipe

    out = tmp_path / "recipe"
    assert main(["calibrate", "--model", str(tiny_model_dir), "--text", str(text_file), "--samples", "2",
                 "--seqlen", "64", "--outliers", "1", "--out", str(out), "--avg-bits", "3.5", "--kl", "--kl-seqlen",
                 "48"]) == 0
    assert "nuq@3.5:kl:chan" in capsys.readouterr().out
    recipe = Recipe.load(out)
    table = recipe.meta["sensitivity"][sensitivity_key(1)]
    layers = recipe.meta["model"]["fingerprint"]["layers"]
    assert (table["bits"], table["fractions"], table["seqlen"]) == ([3], [0.0, 0.01], 48)
    assert len(table["kl"]) == layers * 2 * 2
    assert {"3.5", "3.5:chan", "3.5:kl", "3.5:kl:chan"} <= set(recipe.meta["budgets"])
    stored = recipe.meta["budgets"][budget_key(3.5, 1, "kl", unit="channel")]
    now = allocate_channels(recipe, 3.5, proxy="kl")
    assert stored["keys"] == now.as_dict()["keys"] and stored["values"] == now.as_dict()["values"]
    assert main(["budget", "--model", str(tiny_model_dir), "--text", str(text_file), "--recipe", str(out),
                 "--seqlen", "48"]) == 0
    measured_again = Recipe.load(out)
    again = measured_again.meta["sensitivity"][sensitivity_key(1)]
    assert again["kl"].keys() == table["kl"].keys()
    # the choices made from the table it replaced are not kept (the Fisher ones do not read it)
    assert {"3.5", "3.5:chan"} <= set(measured_again.meta["budgets"])
    assert not {"3.5:kl", "3.5:kl:chan"} & set(measured_again.meta["budgets"])
    # without --text, on the text the recipe was calibrated on (named in the table)
    assert main(["budget", "--model", str(tiny_model_dir), "--recipe", str(out), "--seqlen", "48"]) == 0
    assert Recipe.load(out).meta["sensitivity"][sensitivity_key(1)]["text"] == again["text"] == str(text_file)
    for key, value in table["kl"].items():
        assert again["kl"][key] == pytest.approx(value, rel=1e-6), key
    assert main(["budget", "--model", str(tiny_model_dir), "--text", str(text_file), "--recipe", str(out),
                 "--bits", "5"]) == 2
    assert "calibrated with" in capsys.readouterr().err


def test_budget_is_refused_while_a_calibration_writes_its_recipe(tiny_recipe_dir, tiny_model_dir, tmp_path, capsys):
    """`kvsqueeze budget` loads a recipe, measures for minutes and writes it back: a calibration into the same
    directory meanwhile would be overwritten by the old recipe plus the new table. It holds the directory's run
    lock as a calibration does, and is refused at once while another process holds it."""
    import shutil
    import subprocess
    import sys

    d = tmp_path / "r"
    shutil.copytree(tiny_recipe_dir, d)
    code = ("import time\nfrom kvsqueeze.recipe import RUN_LOCK_FILE, writing\n"
            f"with writing({str(d)!r}, lock=RUN_LOCK_FILE, wait=False):\n    print('held', flush=True)\n"
            "    time.sleep(120)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["budget", "--model", str(tiny_model_dir), "--recipe", str(d), "--seqlen", "48"]) == 2
    finally:
        holder.kill()
        holder.wait()
    assert "another kvsqueeze process is writing a recipe to" in capsys.readouterr().err


def test_a_calibration_too_short_for_an_outlier_fraction_is_refused_before_any_work(tiny_model_dir, tmp_path,
                                                                                     capsys, monkeypatch):
    """126 tokens leave no value outside a 0.1% range (the range would be the one without outliers, and
    `nuq3-0.1%` a method keeping nothing exact): refused before the model loads, naming the fix."""
    from kvsqueeze.integrations import loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    assert main(["calibrate", "--model", str(tiny_model_dir), "--samples", "2", "--seqlen", "64",
                 "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "--outliers 0.1: 126 calibration tokens" in err and "more than 1000 tokens" in err


@pytest.mark.parametrize("argv, match", [
    (["--kl-bits", "3"], "--kl-bits set(s) what --kl measures: add --kl"),
    (["--kl-windows", "4", "--kl-seqlen", "48"], "--kl-windows, --kl-seqlen set(s) what --kl measures"),
    (["--kl", "--kl-bits", "5"], "--kl-bits 5: this calibration fits --bits 2,3,4 only"),
    (["--kl", "--kl-outliers", "5"], "--kl-outliers 5: this calibration fits --outliers 1 only"),
    (["--seqlen", "2", "--sinks", "1"], "--seqlen 2 with --sinks 1 leaves 1 token(s)"),
    (["--seqlen", "64", "--sinks", "64"], "give --seqlen of at least 66"),
])
def test_calibrate_options_that_cannot_work_are_refused_before_the_model_loads(tiny_model_dir, tmp_path, capsys,
                                                                                monkeypatch, argv, match):
    """What --kl measures must be among what the calibration fits, and needs --kl; a window must leave two
    tokens after its sinks (the last carries no gradient). Each was found only after the whole calibration."""
    from kvsqueeze.integrations import loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    base = ["calibrate", "--model", str(tiny_model_dir), "--samples", "2", "--seqlen", "64", "--outliers", "1",
            "--out", str(tmp_path / "r")]
    assert main(base + argv) == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "r" / "recipe.json").exists()


def test_a_calibration_whose_budget_fails_keeps_its_recipe(tiny_model_dir, text_file, tmp_path, capsys):
    """--avg-bits below what the recipe can store is known only once it is fitted: the fitted recipe is written
    (without stored budgets), the error says so, and the recipe loads."""
    from kvsqueeze.recipe import Recipe

    out = tmp_path / "r"
    assert main(["calibrate", "--model", str(tiny_model_dir), "--text", str(text_file), "--samples", "2",
                 "--seqlen", "64", "--outliers", "1", "--out", str(out), "--avg-bits", "2"]) == 2
    err = capsys.readouterr().err
    assert "below what this recipe can store" in err and f"the calibrated recipe is written to {out}" in err
    recipe = Recipe.load(out)
    assert "budgets" not in recipe.meta and recipe.meta["timings_s"]["total"] > 0


def test_kl_seqlen_beyond_the_model_context_is_refused(tiny_model_dir, text_file, tmp_path, capsys):
    from transformers import AutoConfig

    limit = AutoConfig.from_pretrained(tiny_model_dir).max_position_embeddings
    assert main(["calibrate", "--model", str(tiny_model_dir), "--text", str(text_file), "--samples", "2",
                 "--seqlen", "64", "--outliers", "1", "--out", str(tmp_path / "r"), "--kl", "--kl-seqlen",
                 str(limit + 1)]) == 2
    assert f"--kl-seqlen {limit + 1} exceed(s) the model's {limit}-token context" in capsys.readouterr().err


@pytest.mark.parametrize("command", [
    ["eval", "--methods", "fp16", "--max-windows", "1", "--seqlen", "64", "--text", "TEXT"],
    ["passkey", "--methods", "fp16", "--lengths", "256"],
    ["ruler", "--methods", "fp16", "--lengths", "256", "--text", "TEXT"],
])
@pytest.mark.parametrize("where", ["a directory", "under a file"])
def test_an_output_that_cannot_be_written_is_refused_before_the_model_loads(tiny_model_dir, text_file, tmp_path,
                                                                             capsys, monkeypatch, command, where):
    """--json naming a directory, or a path under a file, failed only when the results were written, after the
    whole run."""
    from kvsqueeze.integrations import loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    (tmp_path / "afile").write_text("x")
    target = tmp_path if where == "a directory" else tmp_path / "afile" / "out.json"
    command = [str(text_file) if a == "TEXT" else a for a in command]
    assert main(command + ["--model", str(tiny_model_dir), "--json", str(target)]) == 2
    err = capsys.readouterr().err
    assert f"--json {target} " + ("is a directory" if where == "a directory" else "lies under") in err
