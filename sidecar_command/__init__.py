"""The umbrella ``sidecar`` command: ``sidecar vllm|sglang|frontend [flags...]``.

It sits above every program it starts and imports each only when chosen, so that
``sidecar vllm`` never pays for (or breaks on) the SGLang package or the frontend.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Final

from sidecar_common.flags import FlagParser
from sidecar_common.version import add_version_flag
from sidecar_server.config import EngineSpec

__all__ = ["ENGINES", "PROGRAMS", "engine_spec", "main"]

# Program name -> the module whose ``main(argv, prog=...)`` runs it.
PROGRAMS: Final[Mapping[str, str]] = {
    "vllm": "sidecar_vllm.__main__",
    "sglang": "sidecar_sglang.__main__",
    "frontend": "sidecar_frontend.__main__",
}

# The programs that are sidecars (each module also defines ``SPEC``, its EngineSpec).
ENGINES: Final = ("vllm", "sglang")


def engine_spec(name: str) -> EngineSpec:
    """The EngineSpec of a sidecar engine, imported on demand."""
    spec = importlib.import_module(PROGRAMS[name]).SPEC
    if not isinstance(spec, EngineSpec):
        raise ImportError(f"{PROGRAMS[name]} defines no SPEC")
    return spec


def _top_parser() -> FlagParser:
    parser = FlagParser(
        prog="sidecar",
        usage="sidecar {%s} [flags...]" % ",".join(PROGRAMS),  # noqa: UP031
        description="gRPC sidecar between an LLM serving frontend and an inference engine.",
        epilog="Run `sidecar ENGINE --help` for the flags of one engine.",
    )
    add_version_flag(parser)
    parser.add_argument(
        "engine", choices=tuple(PROGRAMS), help="the inference engine to serve, or the HTTP frontend"
    )
    return parser


def _program(name: str) -> Callable[..., int]:
    module = importlib.import_module(PROGRAMS[name])
    run: Callable[..., int] = module.run
    return run


def main(argv: Sequence[str] | None = None) -> int:
    """``sidecar PROGRAM [flags...]``; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    top = _top_parser()
    if not args or args[0].startswith("-"):
        # `sidecar --help` / `--version` exit 0; anything else without a program is 2.
        if args and args[0] in ("-h", "--help", "--version"):
            top.parse_args(args[:1])
        top.error(f"an engine name is required (choose from {', '.join(PROGRAMS)})")
    name = args[0]
    if name not in PROGRAMS:
        top.error(f"unknown engine {name!r} (choose from {', '.join(PROGRAMS)})")
    try:
        run = _program(name)
    except ImportError as err:
        top.exit(2, f"sidecar: engine {name!r} is not available: {err}\n")
    return run(args[1:], prog=f"sidecar {name}")
