"""``sidecar-vllm`` / ``python -m sidecar_vllm``: the sidecar for a vLLM engine."""

from __future__ import annotations

import argparse

from sidecar_common.cli import run_engine
from sidecar_common.config import EngineSpec, SidecarConfig
from sidecar_common.engine import Engine
from sidecar_vllm.engine import VllmEngine

__all__ = ["SPEC", "main"]


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    # vLLM needs no flags beyond the common ones: everything else is discovered.
    del parser


def _build(config: SidecarConfig, namespace: argparse.Namespace) -> Engine:
    del namespace
    return VllmEngine(config)


SPEC = EngineSpec(name="vllm", add_arguments=_add_arguments, build=_build)


def main() -> None:
    raise SystemExit(run_engine(SPEC))


if __name__ == "__main__":
    main()
