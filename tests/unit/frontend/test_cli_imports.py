"""``sidecar-frontend --help`` and the flag parsing import no numpy: numpy is what the routing
keys are computed with (sidecar_common.kv_keys), which the command line does not need, and
importing it costs a tenth of a second before any usage error or help text."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

_PROBE = textwrap.dedent(
    """
    import sys
    from sidecar_frontend.__main__ import run
    from sidecar_frontend.cli import parse_config

    try:
        run([{argv}])
    except SystemExit as exit:
        code = exit.code
    else:
        code = None
    # The routing flags, parsed into the config the server is given.
    parse_config(
        ["--worker", "127.0.0.1:50061", "--routing", "approx", "--routing-index-max-mb", "64"], {{}}
    )
    print(code, "numpy" in sys.modules)
    """
)


@pytest.mark.parametrize(
    ("argv", "code"),
    [('"--help"', "0"), ('"--routing", "nonsense"', "2")],
    ids=["help", "usage-error"],
)
def test_the_command_line_imports_no_numpy(argv: str, code: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE.format(argv=argv)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.split()[-2:] == [code, "False"], done.stdout + done.stderr
