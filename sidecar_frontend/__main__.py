"""``sidecar-frontend`` (also ``sidecar frontend`` and ``python -m sidecar_frontend``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from sidecar_common.grpc_core import choose_core_settings
from sidecar_frontend.cli import parse_config

__all__ = ["main", "run"]


def run(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """Run the frontend with ``argv`` (default: the process's arguments); the exit code."""
    config = parse_config(sys.argv[1:] if argv is None else argv, os.environ, prog=prog)
    choose_core_settings()
    # Imported late: --help and usage errors need neither aiohttp's server nor grpc (and grpc
    # must load after its settings are chosen).
    from sidecar_frontend.server import run as serve

    return serve(config)


def main() -> None:
    raise SystemExit(run())


if __name__ == "__main__":
    main()
