# The sidecar image. The first argument chooses the engine, the rest are its flags (or their
# SIDECAR_* variables):
#   docker run IMAGE vllm --grpc-endpoint 127.0.0.1:50051
#   docker run IMAGE sglang --grpc-endpoint 127.0.0.1:30000
# Build from the repository root: docker build -t llm-sidecars:0.1.0 .
# The base is pinned by tag; pin it by digest too in a registry you control.

# Stage 1: build the wheel and install it, with its dependencies, into a venv.
FROM python:3.11.14-slim-bookworm AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sidecar_common ./sidecar_common
COPY sidecar_vllm ./sidecar_vllm
COPY sidecar_sglang ./sidecar_sglang
COPY sidecar_frontend ./sidecar_frontend
COPY testkit ./testkit
# Every dependency ships manylinux wheels for CPython 3.11: nothing is compiled here either.
RUN python -m pip wheel --no-deps --wheel-dir /dist . \
    && python -m venv /opt/llm-sidecars \
    && /opt/llm-sidecars/bin/python -m pip install /dist/llm_sidecars-*.whl

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
# gRPC for the frontends (--listen), Prometheus metrics (--metrics-port).
EXPOSE 50061 9400
ENTRYPOINT ["sidecar"]
CMD ["--help"]
