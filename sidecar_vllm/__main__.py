"""``sidecar-vllm`` / ``python -m sidecar_vllm``: the sidecar for a vLLM engine."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from sidecar_server.cli import run_engine
from sidecar_server.config import EngineSpec, SidecarConfig

if TYPE_CHECKING:
    from sidecar_server.engine import Engine

__all__ = ["SPEC", "main", "run"]


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    # vLLM needs no flags beyond the common ones: everything else is discovered.
    del parser


def _build(config: SidecarConfig, namespace: argparse.Namespace) -> Engine:
    # Imported once the flags are valid: --help and usage errors need no grpc.
    from sidecar_vllm.engine import VllmEngine

    del namespace
    return VllmEngine(config)


SPEC = EngineSpec(name="vllm", add_arguments=_add_arguments, build=_build)


def run(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """Run this sidecar with ``argv`` (default: the process's arguments); the exit code."""
    return run_engine(SPEC, argv, prog=prog)


def main() -> None:
    raise SystemExit(run())


if __name__ == "__main__":
    main()
