# The image of this repository: every sidecar and the HTTP frontend, one console script
# (`sidecar`) whose first argument chooses what runs; the rest are its flags (or their
# SIDECAR_* / SIDECAR_FRONTEND_* variables). Build it from the repository root as
#   docker build -t registry.example.com/llm-sidecars:0.1.0 .
# (the name deploy/README.md and deploy/kubernetes use; put your registry in front), then e.g.
#   docker run IMAGE vllm --grpc-endpoint 127.0.0.1:50051       # vLLM's gRPC port
#   docker run IMAGE sglang --grpc-endpoint 127.0.0.1:30001     # SGLang's gRPC port (--grpc-port)
#   docker run IMAGE frontend --discovery etcd --etcd-endpoints 10.0.0.2:2379
# The base is pinned by tag; pin it by digest too in a registry you control. Every Python
# package comes at the version requirements.lock pins (`make lock` refreshes it).

# Stage 1: build the wheel and install it, with its dependencies, into a venv.
FROM python:3.11.14-slim-bookworm AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md requirements.lock ./
COPY sidecar_common ./sidecar_common
COPY sidecar_server ./sidecar_server
COPY sidecar_vllm ./sidecar_vllm
COPY sidecar_sglang ./sidecar_sglang
COPY sidecar_frontend ./sidecar_frontend
COPY sidecar_command ./sidecar_command
# The build backend at its locked version, then the wheel built with it (no isolated build
# environment that would fetch whatever setuptools is newest). Every dependency ships
# manylinux wheels for CPython 3.11: nothing is compiled here either.
RUN python -m pip install --constraint requirements.lock setuptools \
    && python -m pip wheel --no-deps --no-build-isolation --wheel-dir /dist . \
    && python -m venv /opt/llm-sidecars \
    && /opt/llm-sidecars/bin/python -m pip install --constraint requirements.lock /dist/llm_sidecars-*.whl

# Stage 2: the same slim Python (no compilers, no build tools), the venv, a non-root user.
FROM python:3.11.14-slim-bookworm
RUN useradd --system --uid 65532 --user-group --no-create-home --shell /usr/sbin/nologin sidecar
COPY --from=build /opt/llm-sidecars /opt/llm-sidecars
# Bytecode was compiled at install time; the root filesystem may be mounted read-only.
ENV PATH=/opt/llm-sidecars/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SIDECAR_LOG_FORMAT=json
USER 65532:65532
# A sidecar: gRPC for the frontends (--listen), Prometheus metrics (--metrics-port).
# The frontend (`frontend ...`): HTTP (--listen), its metrics (the port deploy/kubernetes uses).
EXPOSE 50061 9400 8000 9401
ENTRYPOINT ["sidecar"]
CMD ["--help"]
