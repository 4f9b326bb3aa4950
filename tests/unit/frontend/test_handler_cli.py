"""The frontend's command line: flags, SIDECAR_FRONTEND_* mirrors, usage errors (exit 2)."""

from __future__ import annotations

import pytest

from sidecar_frontend.cli import parse_config


def test_defaults() -> None:
    config = parse_config(["--worker", "127.0.0.1:50061"], {})
    assert config.listen == "0.0.0.0:8000"
    assert config.discovery.mode == "static"
    assert config.discovery.static_workers == (("127.0.0.1:50061", "agg"),)
    assert config.formats == ("sglang", "vllm")
    assert config.handler.request_timeout == 3600.0
    assert config.sglang_incremental_streaming_output is False
    assert config.metrics_port is None


def test_workers_repeat_or_list_with_roles_and_duplicates_collapse() -> None:
    config = parse_config(["--worker", "a:1,decode=b:2", "--worker", "c:3", "--worker", "a:1"], {})
    assert config.discovery.static_workers == (("a:1", "agg"), ("b:2", "decode"), ("c:3", "agg"))


def test_dynamic_discovery_replaces_the_static_list() -> None:
    config = parse_config(["--discovery", "dns", "--dns-name", "workers.ns.svc:50061"], {})
    assert config.discovery.mode == "dns"
    assert config.discovery.static_workers == ()


def test_every_flag_has_its_variable_and_the_flag_wins() -> None:
    env = {
        "SIDECAR_FRONTEND_WORKER": "a:1 b:2",
        "SIDECAR_FRONTEND_LISTEN": "127.0.0.1:9000",
        "SIDECAR_FRONTEND_FORMAT": "sglang",
        "SIDECAR_FRONTEND_SGLANG_INCREMENTAL_STREAMING_OUTPUT": "true",
        "SIDECAR_FRONTEND_REQUEST_TIMEOUT_SECS": "0",
        "SIDECAR_FRONTEND_METRICS_PORT": "9100",
    }
    config = parse_config([], env)
    assert [a for a, _ in config.discovery.static_workers] == ["a:1", "b:2"]
    assert config.listen == "127.0.0.1:9000"
    assert config.formats == ("sglang",)
    assert config.sglang_incremental_streaming_output is True
    assert config.handler.request_timeout is None, "0 turns the deadline off"
    assert config.metrics_port == 9100
    assert parse_config(["--listen", "127.0.0.1:1"], env).listen == "127.0.0.1:1"


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        (["--admin-token", "a b"], {}, "--admin-token"),
        (
            ["--processes", "2", "--admin-listen", "127.0.0.1:9"],
            {},
            "--admin-listen is used only with --processes 1",
        ),
        (["--worker", "a:port"], {}, "--worker"),
        (["--worker", "a:1", "--discovery", "etcd", "--etcd-endpoints", "e:2379"], {}, "--worker"),
        (["--worker", "a:1", "--format", "sglang,openai"], {}, "--format"),
        (["--worker", "a:1", "--request-timeout-secs", "-1"], {}, "--request-timeout-secs"),
        (["--worker", "a:1"], {"SIDECAR_FRONTEND_LISTEN": "nowhere"}, "SIDECAR_FRONTEND_LISTEN"),
        # Flags the chosen mode does not use (docs/common.md), named with their variable.
        (["--worker", "a:1", "--etcd-prefix", "/p/"], {}, "--etcd-prefix is used only with --discovery etcd"),
        (
            ["--worker", "a:1"],
            {"SIDECAR_FRONTEND_ETCD_ENDPOINTS": "e:2379"},
            "SIDECAR_FRONTEND_ETCD_ENDPOINTS",
        ),
        (
            ["--worker", "a:1", "--dns-refresh-secs", "9"],
            {},
            "--dns-refresh-secs is used only with --discovery dns",
        ),
        (
            ["--worker", "a:1", "--format", "vllm"],
            {"SIDECAR_FRONTEND_SGLANG_INCREMENTAL_STREAMING_OUTPUT": "1"},
            "comes from SIDECAR_FRONTEND_SGLANG_INCREMENTAL_STREAMING_OUTPUT",
        ),
    ],
)
def test_usage_errors_exit_2_naming_the_flag_or_variable(
    argv: list[str], env: dict[str, str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(argv, env)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert named in err
    assert err.startswith("sidecar-frontend: error: ")
    assert err.count("\n") == 1, "one line, not the whole usage"


def test_prefill_workers_join_the_static_list_with_their_role() -> None:
    config = parse_config(["--worker", "decode=a:1", "--prefill-worker", "b:2,c:3"], {})
    assert config.discovery.static_workers == (("a:1", "decode"), ("b:2", "prefill"), ("c:3", "prefill"))
    config = parse_config(["--worker", "decode=a:1"], {"SIDECAR_FRONTEND_PREFILL_WORKER": "b:2"})
    assert config.discovery.static_workers == (("a:1", "decode"), ("b:2", "prefill"))


def test_a_prefill_worker_with_a_role_prefix_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--prefill-worker", "decode=b:2"], {})
    assert exit_info.value.code == 2
    assert "--prefill-worker" in capsys.readouterr().err


def test_migration_limit_flag_variable_default_and_negative() -> None:
    assert parse_config(["--worker", "a:1"], {}).handler.migration_limit == 3
    env = {"SIDECAR_FRONTEND_MIGRATION_LIMIT": "0"}
    assert parse_config(["--worker", "a:1"], env).handler.migration_limit == 0
    assert parse_config(["--worker", "a:1", "--migration-limit", "5"], env).handler.migration_limit == 5
    with pytest.raises(SystemExit):
        parse_config(["--worker", "a:1", "--migration-limit", "-1"], {})


def test_metrics_host_and_models_default_to_none_and_the_listen_host_is_used_for_metrics() -> None:
    config = parse_config(["--worker", "127.0.0.1:50061"], {})
    assert config.metrics_host is None
    assert config.worker_set.models == frozenset()
    argv = ["--worker", "127.0.0.1:50061", "--metrics-port", "9100", "--metrics-host", "127.0.0.1"]
    config = parse_config([*argv, "--model", "a,b", "--model", "c"], {})
    assert config.metrics_host == "127.0.0.1"
    assert config.worker_set.models == frozenset({"a", "b", "c"})
    env = {"SIDECAR_FRONTEND_METRICS_HOST": "[::1]", "SIDECAR_FRONTEND_MODEL": "m"}
    config = parse_config(["--worker", "127.0.0.1:50061", "--metrics-port", "9100"], env)
    assert (config.metrics_host, config.worker_set.models) == ("::1", frozenset({"m"}))


def test_metrics_host_without_metrics_port_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_config(["--worker", "127.0.0.1:50061", "--metrics-host", "127.0.0.1"], {})
    assert exit_.value.code == 2
    assert "--metrics-host needs --metrics-port" in capsys.readouterr().err


def test_a_switch_its_variable_turns_off_is_not_a_flag_that_does_not_apply() -> None:
    off = {"SIDECAR_FRONTEND_SGLANG_INCREMENTAL_STREAMING_OUTPUT": "false"}
    config = parse_config(["--worker", "a:1", "--format", "vllm"], off)
    assert config.sglang_incremental_streaming_output is False


def test_routing_flags_reach_the_router_config() -> None:
    default = parse_config(["--worker", "a:1"], {}).routing
    assert default.routing is None, "kv where workers publish, approx elsewhere"
    assert default.index_max_bytes == 256 * 1024 * 1024
    assert default.approx_ttl == 120.0
    policy = default.policy
    assert (policy.hot_spot_ratio, policy.hot_spot_slack, policy.left_behind_weight) == (1.5, 4, 1.0)
    argv = [
        "--worker",
        "a:1",
        "--routing",
        "approx",
        "--routing-index-max-mb",
        "64",
        "--routing-approx-ttl-secs",
        "30",
        "--routing-hot-spot-ratio",
        "2.5",
        "--routing-hot-spot-slack",
        "0",
        "--routing-left-behind-weight",
        "0",
    ]
    config = parse_config(argv, {}).routing
    assert config.routing is not None
    assert config.routing.value == "approx"
    assert config.index_max_bytes == 64 * 1024 * 1024
    assert config.approx_ttl == 30.0
    policy = config.policy
    assert (policy.hot_spot_ratio, policy.hot_spot_slack, policy.left_behind_weight) == (2.5, 0, 0.0)
    from_env = parse_config(["--worker", "a:1"], {"SIDECAR_FRONTEND_ROUTING_LEFT_BEHIND_WEIGHT": "0.5"})
    assert from_env.routing.policy.left_behind_weight == 0.5


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--routing-left-behind-weight", "-1"], "--routing-left-behind-weight"),
        (["--routing-left-behind-weight", "nan"], "--routing-left-behind-weight"),
        (["--routing-left-behind-weight", "inf"], "--routing-left-behind-weight"),
        (["--routing-hot-spot-ratio", "0.5"], "--routing-hot-spot-ratio"),
        (["--routing-hot-spot-slack", "-1"], "--routing-hot-spot-slack"),
        (["--routing-hot-spot-slack", "1.5"], "--routing-hot-spot-slack"),
        (
            ["--routing", "round-robin", "--routing-hot-spot-slack", "3"],
            "--routing-hot-spot-slack is used only with --routing kv or approx",
        ),
        (
            ["--routing", "load", "--routing-left-behind-weight", "2"],
            "--routing-left-behind-weight is used only with --routing kv or approx",
        ),
        (
            ["--routing", "random", "--routing-hot-spot-ratio", "2"],
            "--routing-hot-spot-ratio is used only with --routing kv or approx",
        ),
    ],
)
def test_routing_usage_errors_name_the_flag(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--worker", "a:1", *argv], {})
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def test_the_kv_stream_bounds_reach_the_worker_set_and_default_to_its_own() -> None:
    default = parse_config(["--worker", "a:1"], {}).worker_set
    assert (default.kv_max_snapshot_keys, default.kv_max_update_keys) == (4_000_000, 262_144)
    flags = ["--routing-max-snapshot-keys", "1000", "--routing-max-update-keys", "10"]
    given = parse_config(["--worker", "a:1", *flags], {}).worker_set
    assert (given.kv_max_snapshot_keys, given.kv_max_update_keys) == (1000, 10)
    env = {"SIDECAR_FRONTEND_ROUTING_MAX_SNAPSHOT_KEYS": "7"}
    assert parse_config(["--worker", "a:1"], env).worker_set.kv_max_snapshot_keys == 7
