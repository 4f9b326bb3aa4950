"""The installed distribution's version: a leaf module both the CLI and the daemon read."""

from __future__ import annotations

import importlib.metadata

__all__ = ["package_version"]


def package_version() -> str:
    try:
        return importlib.metadata.version("llm-sidecars")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
