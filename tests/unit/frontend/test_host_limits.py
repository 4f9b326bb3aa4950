"""The open files limit and the listen backlog as the frontend meets them (host_limits.py)."""

from __future__ import annotations

import resource

import pytest

from sidecar_frontend.host_limits import OpenFiles, effective_backlog, open_files_problem, open_files_target

INFINITY = resource.RLIM_INFINITY


@pytest.mark.parametrize(
    ("soft", "hard", "target"),
    [
        (1024, 524288, 524288),  # raised to the hard limit
        (20000, 20000, 20000),  # already there
        (1024, INFINITY, 1048576),  # an unlimited hard limit: the kernel's own ceiling
        (INFINITY, INFINITY, INFINITY),  # nothing to raise
        (4096, 1024, 4096),  # never lowered (a soft limit above the hard one cannot be set anyway)
    ],
)
def test_open_files_target(soft: int, hard: int, target: int) -> None:
    assert open_files_target(soft, hard, 1048576) == target


@pytest.mark.parametrize(
    ("limits", "minimum", "refused"),
    [
        (OpenFiles(before=1024, soft=4096, hard=4096), None, False),
        (OpenFiles(before=1024, soft=4096, hard=4096), 4096, False),
        (OpenFiles(before=1024, soft=4096, hard=4096), 20000, True),
        (OpenFiles(before=INFINITY, soft=INFINITY, hard=INFINITY), 20000, False),
    ],
)
def test_min_open_files(limits: OpenFiles, minimum: int | None, refused: bool) -> None:
    problem = open_files_problem(limits, minimum)
    assert (problem is not None) is refused
    if problem is not None:
        assert "4096" in problem
        assert f"--min-open-files {minimum}" in problem


@pytest.mark.parametrize(
    ("asked", "somaxconn", "granted"),
    [(4096, 4096, 4096), (4096, 128, 128), (64, 4096, 64), (4096, None, 4096)],
)
def test_the_kernel_caps_the_backlog(asked: int, somaxconn: int | None, granted: int) -> None:
    assert effective_backlog(asked, somaxconn) == granted
