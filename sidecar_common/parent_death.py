"""A child that must not outlive the process that started it: the frontend's managed sidecars.

The parent puts its own pid in the child's environment under :data:`PARENT_PID_VARIABLE`; the
child calls :func:`die_with_parent` first thing. On Linux that asks the kernel for SIGTERM when
the parent dies (``prctl(PR_SET_PDEATHSIG)``), so a frontend killed with SIGKILL leaves no
sidecar behind; and since the parent may have died before the call, the child then checks that
its parent is still the one named, and should exit at once otherwise. Elsewhere than Linux only
that check is made.

The child does this itself, rather than the parent between fork and exec (``preexec_fn``):
Python code run in a child forked from a process with grpc's threads could abort (a managed
sidecar exited with SIGABRT before its exec in a test run), and the standard library warns
against ``preexec_fn`` with threads.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Mapping
from typing import Final

__all__ = ["PARENT_PID_VARIABLE", "die_with_parent"]

PARENT_PID_VARIABLE: Final = "SIDECAR_DIE_WITH_PARENT"
_PR_SET_PDEATHSIG: Final = 1


def die_with_parent(environ: Mapping[str, str]) -> bool:
    """Ask for SIGTERM when the parent ``environ`` names dies; False when that parent is gone
    already (the caller exits). True when no parent is named, or the value is not a pid."""
    value = environ.get(PARENT_PID_VARIABLE)
    if value is None or not value.isdigit():
        return True
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    return os.getppid() == int(value)
