"""A managed child's guard against outliving its parent (sidecar_common/parent_death.py): the
check half, in process; the kernel's SIGTERM is tests/process/test_parent_death_process.py's."""

from __future__ import annotations

import os

import pytest

from sidecar_common.parent_death import PARENT_PID_VARIABLE, die_with_parent


@pytest.mark.parametrize(
    ("environ", "goes_on"),
    [
        ({}, True),  # not a managed child: nothing asked
        ({PARENT_PID_VARIABLE: str(os.getppid())}, True),  # its parent is the one named
        ({PARENT_PID_VARIABLE: str(os.getppid() + 1_000_000)}, False),  # that parent is gone
        ({PARENT_PID_VARIABLE: "not-a-pid"}, True),
    ],
)
def test_a_child_goes_on_only_while_the_parent_named_is_its_parent(
    environ: dict[str, str], goes_on: bool
) -> None:
    assert die_with_parent(environ) is goes_on
