"""The bench starts the sidecars with command lines the real CLI accepts (a refused flag would
stop `make bench` at that hop instead of measuring it)."""

from __future__ import annotations

import pytest

from bench import plan
from sidecar_server.cli import parse_config
from sidecar_sglang.__main__ import SPEC as SGLANG
from sidecar_vllm.__main__ import SPEC as VLLM


@pytest.mark.parametrize(
    "hop",
    [
        plan.HopSpec("sidecar", plan.EngineSpec("vllm", 1)),
        plan.HopSpec("sidecar-grpc", plan.EngineSpec("sglang", 1)),
        plan.HopSpec("sidecar-http", plan.EngineSpec("sglang", 1)),
    ],
    ids=lambda hop: f"{hop.engine.kind}-{hop.path}",
)
def test_every_sidecar_hop_command_line_parses(hop: plan.HopSpec) -> None:
    argv = plan.hop_argv(hop, "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")
    spec = VLLM if hop.engine.kind == "vllm" else SGLANG
    config, namespace = parse_config(spec, argv[1:], {})
    assert config.listen == "127.0.0.1:1"
    # Building the engine adapter does no I/O and applies the flag rules parsing leaves to it.
    assert spec.build(config, namespace).name == hop.engine.kind


@pytest.mark.parametrize("path", ["bare-proxy", "convert-floor"])
def test_the_baselines_run_with_the_grpc_settings_our_programs_choose(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    hop = plan.HopSpec(path, plan.EngineSpec("vllm", 1))
    monkeypatch.delenv("GRPC_EXPERIMENTS", raising=False)
    argv = plan.hop_argv(hop, "127.0.0.1:1", "127.0.0.1:2", None)
    assert argv[:2] == ["env", "GRPC_EXPERIMENTS=-event_engine_client"]
    assert argv[3:5] == ["-m", f"bench.{path.replace('-', '_')}"]
    # An operator's own setting reaches the baseline as it reaches the sidecar: unchanged.
    monkeypatch.setenv("GRPC_EXPERIMENTS", "")
    assert plan.hop_argv(hop, "127.0.0.1:1", "127.0.0.1:2", None)[1:3] == [
        "-m",
        f"bench.{path.replace('-', '_')}",
    ]
