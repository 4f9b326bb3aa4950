"""What every long-running program (the sidecars, the frontend) shares at its edges: its exit
codes, and how it runs its event loop.

Standard library only at import time (anyio and uvloop are imported when the loop starts), so
a command line can name the exit codes without loading the async stack.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final, TypeVarTuple, Unpack

__all__ = ["EXIT_OK", "EXIT_STARTUP_FAILED", "EXIT_USAGE", "run_event_loop"]

EXIT_OK: Final = 0  # stopped as asked (a signal, a drain), or --help / --version
EXIT_STARTUP_FAILED: Final = 1  # could not start: an address to bind, an engine, a file
EXIT_USAGE: Final = 2  # a flag or variable that cannot be used (argparse's own code)

_Args = TypeVarTuple("_Args")


def run_event_loop(main: Callable[[Unpack[_Args]], Awaitable[int]], *args: *_Args) -> int:
    """Run ``main(*args)`` to its exit code: anyio on asyncio, with uvloop when it is
    installed. Ctrl-C before the program's own signal handling is in place is still a
    requested stop (EXIT_OK)."""
    import anyio

    options: dict[str, object] = {}
    try:
        import uvloop

        options["loop_factory"] = uvloop.new_event_loop
    except ImportError:
        pass
    try:
        return anyio.run(main, *args, backend="asyncio", backend_options=options)
    except KeyboardInterrupt:
        return EXIT_OK
