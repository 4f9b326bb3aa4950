"""docs/api.md promises the 0.1 Struct shapes (``engine_data.prompt_logprobs``, the bootstrap
triple in ``disaggregated_params``) are written and read through 0.2.x only: the release that
reaches 0.3 must drop them, and this test says so until it does."""

from __future__ import annotations

import tomllib

from sidecar_common import bootstrap_handoff, prompt_logprobs
from tests.deploy.conftest import ROOT


def test_the_struct_shapes_are_gone_by_0_3() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    major, minor = (int(part) for part in version.split(".")[:2])
    still_there = [
        m.__name__
        for m in (prompt_logprobs, bootstrap_handoff)
        if hasattr(m, "to_struct_rows") or hasattr(m, "to_struct")
    ]
    if (major, minor) >= (0, 3):
        assert not still_there, f"{version}: drop the 0.1 Struct shapes (docs/api.md): {still_there}"
