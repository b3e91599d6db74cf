"""lm-evaluation-harness with a quantized KV cache: the model "kvsqueeze" for `lm_eval`.

    kvsqueeze-lm-eval --model kvsqueeze \\
        --model_args pretrained=smollm2-135m,recipe=out/recipe,method=q3.5 \\
        --tasks hellaswag --device cpu

`kvsqueeze-lm-eval` is lm-eval's own command line (`lm_eval.__main__.cli_evaluate`) with this model
registered first: lm-eval 0.4.13 reads no plugin entry points, so registering it is what the wrapper adds
(the entry point `lm_eval.models: kvsqueeze` is declared too, for versions that read one). From Python,
`lm_eval.simple_evaluate(model=KVSqueezeLM(...), tasks=[...])` needs no wrapper.

What each request type measures (the model is lm-eval's `HFLM`, given the model kvsqueeze loads):

* loglikelihood, multiple choice and perplexity (`loglikelihood_rolling`) tasks score one forward pass
  over the whole text: it runs inside the method's `SimulatedQuantization`, so every token's keys and
  values are quantized as they enter the cache, exactly as `kvsqueeze eval` measures perplexity;
* generation tasks (`generate_until`) decode through the compressed cache (`cache_for`) with the fused
  decode kernel, for the methods it stores; the other methods (KIVI, per-token int, turbo) generate
  through the simulated cache.

model_args: `pretrained` (a bundled name such as smollm2-135m, a local directory or an offline hub id),
`recipe` (the calibration directory; required by nuq and per-channel methods), `method` (default q3.5),
`dtype` (default float32), `decode` ("auto": the fused kernel; "dense": dequantize and attend), and HFLM's
own (`batch_size`, `max_length`, ...). lm-eval's default device "cuda:0" means the CPU on a machine
without CUDA.
"""

from __future__ import annotations

import contextlib
import sys

import torch

try:
    import lm_eval.models  # noqa: F401  (its built-in models first: the registry fills itself only when empty)
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("the lm-eval adapter needs lm-eval: pip install 'kvsqueeze[harness]' "
                      f"(lm-eval==0.4.13); the import failed with: {exc}") from exc

from ..config import DEFAULT_DTYPE, DEFAULT_METHOD, DEFAULT_MODEL
from ..methods import DEFAULT_CONTEXT, family, needs_recipe, parse_method, preset_for
from ..recipe import Recipe
from ..shape import context_length
from .loading import load_model
from .prefill import compressed
from .simulate import SimulatedQuantization

NAME = "kvsqueeze"


def _device(device: str | None) -> str:
    if device is None or (str(device).startswith("cuda") and not torch.cuda.is_available()):
        return "cpu"
    return str(device)


@register_model(NAME)
class KVSqueezeLM(HFLM):
    """lm-eval's HF model with kvsqueeze's quantized KV cache; see the module docstring."""

    def __init__(self, pretrained: str = DEFAULT_MODEL, recipe: str | None = None, method: str = DEFAULT_METHOD,
                 dtype: str = DEFAULT_DTYPE, decode: str = "auto", device: str | None = None, **kwargs):
        from .cache import cache_for  # noqa: F401  (import errors now, not at the first generation)

        if kwargs.pop("tokenizer", None) not in (None, "", str(pretrained)):
            raise ValueError("tokenizer=: kvsqueeze loads the tokenizer that comes with the model (pretrained=); "
                             "leave tokenizer= out of --model_args")
        self.spec = parse_method(str(method))
        if needs_recipe(self.spec) and not recipe:
            raise ValueError(f"method {self.spec.name!r} uses offline calibration statistics: add recipe=DIR to "
                             "--model_args (create one with `kvsqueeze calibrate --out DIR`)")
        if decode not in ("auto", "dense", "numba", "reference", "triton"):
            raise ValueError(f"decode={decode!r}: expected auto, dense, numba, reference or triton")
        if getattr(self.spec, "split", False) and str(kwargs.get("batch_size", 1)) != "1":
            raise ValueError(f"method {self.spec.name!r} picks each head's wider half from the whole batch's "
                             "tokens, so a request's score would depend on the requests beside it and their "
                             "padding: use batch_size=1 (--batch_size 1)")
        self.recipe = Recipe.load(recipe) if recipe else None
        self.decode = decode
        model, tok = load_model(str(pretrained), dtype, _device(device))
        from .preflight import model_windows

        self.spec = preset_for(str(method), DEFAULT_CONTEXT, model_windows(model))  # a preset's window: this model's
        self.kv_method_check(model)
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token  # HFLM pads batches
        kwargs.setdefault("max_length", context_length(model.config) or 2048)
        super().__init__(pretrained=model, tokenizer=tok, **kwargs)

    def kv_method_check(self, model) -> None:
        """Build the method's quantizers (and check the recipe against the model) before any request runs."""
        from .preflight import check_methods

        check_methods(model, [self.spec], self.recipe)

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        """Logits of a right-padded batch [B, T], every token's keys and values quantized as they enter."""
        if attn_mask is not None or labels is not None:
            raise ValueError("kvsqueeze evaluates decoder-only models; this request carries encoder inputs")
        with torch.no_grad(), SimulatedQuantization(self.model, self.spec, self.recipe) as sim:
            return self.model(input_ids=inps, cache=sim.new_cache(), use_cache=True).logits

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        """Greedy (or sampled) generation from the method's cache: the compressed cache where it stores the method.

        KIVI's simulation groups keys from a row's first slot, and a simulated method's fp16 sinks are the first
        slots, so a batch padded on the left would mix padding into a row's groups or keep it as sinks: such rows
        are generated one at a time, each without its padding, and put back in the batch's layout (left padding
        restored, right-padded to the longest), as generate returns a batch."""
        mask = generation_kwargs.get("attention_mask")
        simulated_sinks = not compressed(self.spec) and self.spec.quantized and self.spec.sinks > 0
        if ((family(self.spec).quantizes_in_attention or simulated_sinks) and mask is not None
                and context.shape[0] > 1 and bool((mask[:, 0] == 0).any())):
            return self._rows_one_at_a_time(context, max_length, stop, mask, **generation_kwargs)
        with contextlib.ExitStack() as stack:
            if compressed(self.spec) and self.spec.quantized:
                from .cache import cache_for

                cache = stack.enter_context(cache_for(self.model, self.recipe, self.spec))
                if self.decode != "dense":
                    from .fused import fused_decode

                    stack.enter_context(fused_decode(self.model, cache, backend=self.decode))
            elif compressed(self.spec):  # fp16: its own cache layers, the same accounting
                from .cache import cache_for

                cache = stack.enter_context(cache_for(self.model, self.recipe, self.spec))
            else:
                sim = stack.enter_context(SimulatedQuantization(self.model, self.spec, self.recipe))
                cache = sim.new_cache()
            return super()._model_generate(context, max_length, stop, cache=cache, **generation_kwargs)

    def _rows_one_at_a_time(self, context, max_length: int, stop: list[str], mask, **generation_kwargs):
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        rows = []
        for b in range(context.shape[0]):
            lead = int((mask[b].cumsum(0) == 0).sum())  # the row's left padding
            kw = {**generation_kwargs, "attention_mask": mask[b:b + 1, lead:]}
            out = self._model_generate(context[b:b + 1, lead:], max_length - lead, stop, **kw)
            rows.append(torch.cat([context[b:b + 1, :lead], out], dim=1))
        width = max(r.shape[1] for r in rows)
        return torch.cat([torch.nn.functional.pad(r, (0, width - r.shape[1]), value=pad) for r in rows])


def main(argv: list[str] | None = None) -> None:
    """`kvsqueeze-lm-eval`: lm-eval's command line with the "kvsqueeze" model registered."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
