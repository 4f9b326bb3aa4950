"""The grpc core settings our programs choose before grpc loads: added only where the operator
set nothing (an empty value is a choice too), and never after grpc is loaded (it would not read
them, so nothing changes)."""

from __future__ import annotations

import os

import grpc
import pytest

from sidecar_common.grpc_core import CLIENT_EXPERIMENTS, choose_core_settings, core_environment


@pytest.mark.parametrize(
    ("environ", "added"),
    [
        ({}, {"GRPC_EXPERIMENTS": "-event_engine_client"}),
        ({"PATH": "/bin", "GRPC_VERBOSITY": "ERROR"}, {"GRPC_EXPERIMENTS": "-event_engine_client"}),
        ({"GRPC_EXPERIMENTS": ""}, {}),
        ({"GRPC_EXPERIMENTS": "-event_engine_dns"}, {}),
        ({"GRPC_EXPERIMENTS": CLIENT_EXPERIMENTS}, {}),
    ],
)
def test_the_operators_own_value_wins_whole(environ: dict[str, str], added: dict[str, str]) -> None:
    assert core_environment(environ) == added


def test_once_grpc_is_loaded_nothing_is_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    assert grpc.__name__ == "grpc"  # loaded in this process
    monkeypatch.delenv("GRPC_EXPERIMENTS", raising=False)
    assert choose_core_settings() is False
    assert "GRPC_EXPERIMENTS" not in os.environ
