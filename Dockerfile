# One image for all three processes; docker-compose.yml picks the command. CPU build of torch, like `make install`.
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends make gcc && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY . .
RUN make install && .venv/bin/python -m model_worker.loader
ENV PATH=/app/.venv/bin:$PATH
