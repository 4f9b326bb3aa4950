"""The installed distribution's version: a leaf module both the CLI and the daemon read."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

__all__ = ["add_version_flag", "package_version"]


def package_version() -> str:
    # Imported here: importlib.metadata costs every command line a noticeable share of its
    # start-up, and only --version and a starting daemon need it.
    import importlib.metadata

    try:
        return importlib.metadata.version("llm-sidecars")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class _VersionWhenAsked(argparse._VersionAction):
    """argparse's ``--version`` (it stays one, for the flag library's checks), which looks the
    version up only when the flag is given."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        self.version = f"%(prog)s {package_version()}"
        super().__call__(parser, namespace, values, option_string)


def add_version_flag(parser: argparse.ArgumentParser) -> None:
    """``--version``: the program's name and the installed version, exit 0."""
    parser.add_argument("--version", action=_VersionWhenAsked)
