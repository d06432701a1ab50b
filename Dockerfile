# The image every kf service in compose.yaml runs. CPU torch by default; for the GPU
# worker build with --build-arg TORCH_INDEX=<a CUDA wheel index>.
FROM python:3.11-slim
# bubblewrap: the box kf's runner processes start in (docs/sandbox.md); inside a container
# it needs user namespaces (e.g. docker run --security-opt seccomp=unconfined, or a
# runtime that allows them), else kf refuses to evaluate unless --unsafe-no-sandbox
RUN apt-get update && apt-get install -y --no-install-recommends g++ bubblewrap \
  && rm -rf /var/lib/apt/lists/*
ARG TORCH_VERSION=2.13.0
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}"
WORKDIR /opt/kf
COPY pyproject.toml README.md ./
COPY kf kf
COPY agents agents
COPY hardware_agents hardware_agents
COPY schemas schemas
COPY examples examples
RUN pip install --no-cache-dir .
ENV KF_CACHE_DIR=/var/cache/kf
CMD ["kf", "--help"]
