"""The command line as a user types it: defaults, flags, their environment mirrors, refusals;
and the log lines the daemon then writes."""

from __future__ import annotations

import argparse
import io
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime, timedelta

import pytest
import structlog

from sidecar_command import main
from sidecar_common.endpoint import Endpoint
from sidecar_common.flags import at_least_arg, env_var_for, listen_arg
from sidecar_common.logs import OUR_LOGGERS, configure_logging, default_log_format
from sidecar_server.cli import ENV_PREFIX, build_parser, parse_config
from sidecar_server.config import EngineSpec, SidecarConfig
from sidecar_server.engine import Engine


def _add_fake_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--transport", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--http-endpoint", default=None)
    parser.add_argument("--chunk-tokens", type=int, default=4)
    parser.add_argument("--incremental", action="store_true")
    parser.add_argument("--extra-id", type=int, action="append", default=None)


def _no_build(config: SidecarConfig, namespace: argparse.Namespace) -> Engine:
    raise AssertionError("parsing must not build the engine")


SPEC = EngineSpec(name="fake", add_arguments=_add_fake_arguments, build=_no_build)
ENDPOINT = ["--grpc-endpoint", "127.0.0.1:50051"]


def parse(
    argv: Sequence[str], environ: Mapping[str, str] | None = None
) -> tuple[SidecarConfig, argparse.Namespace]:
    return parse_config(SPEC, list(argv), environ or {}, log_format_default="json")


def usage_error(
    capsys: pytest.CaptureFixture[str], argv: Sequence[str], environ: Mapping[str, str] | None = None
) -> str:
    with pytest.raises(SystemExit) as exc:
        parse(argv, environ)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    # One line, never the whole usage: the operator reads what is wrong.
    assert err.startswith("sidecar-fake: error: ")
    assert err.count("\n") == 1, err
    return err


def test_defaults() -> None:
    config, ns = parse(ENDPOINT)
    assert config.pool.endpoint == Endpoint("127.0.0.1", 50051)
    assert config.pool.connections == 8
    assert config.pool.retry.attempt_timeout == 30.0
    assert config.pool.retry.max_interval == 1.0
    assert config.pool.startup_deadline == 1800.0
    assert config.listen == "0.0.0.0:50061"
    assert config.disaggregation_mode == "agg"
    assert config.metrics_port is None
    assert config.log_format == "json"
    assert config.log_level == "info"
    assert config.drain_timeout == 30.0
    assert (ns.transport, ns.http_endpoint, ns.chunk_tokens, ns.incremental) == ("grpc", None, 4, False)


def test_log_format_default_follows_the_terminal() -> None:
    config, _ = parse_config(SPEC, ENDPOINT, {}, log_format_default="console")
    assert config.log_format == "console"
    config, _ = parse_config(SPEC, [*ENDPOINT, "--log-format", "json"], {}, log_format_default="console")
    assert config.log_format == "json"


# (flag, command-line value, environment value, how to read the parsed result, expected for each)
COMMON_FLAGS = [
    ("--grpc-endpoint", "grpc://10.0.0.1:7000", "http://[::1]:7001",
     lambda c, n: c.pool.endpoint, Endpoint("10.0.0.1", 7000), Endpoint("::1", 7001)),
    ("--grpc-connections", "3", "5", lambda c, n: c.pool.connections, 3, 5),
    ("--grpc-connect-attempt-timeout-secs", "2.5", "7", lambda c, n: c.pool.retry.attempt_timeout, 2.5, 7.0),
    ("--grpc-retry-interval-secs", "0.2", "3", lambda c, n: c.pool.retry.max_interval, 0.2, 3.0),
    ("--grpc-startup-deadline-secs", "60", "90", lambda c, n: c.pool.startup_deadline, 60.0, 90.0),
    ("--listen", "127.0.0.1:0", "[::]:6000", lambda c, n: c.listen, "127.0.0.1:0", "[::]:6000"),
    ("--disaggregation-mode", "prefill", "decode", lambda c, n: c.disaggregation_mode, "prefill", "decode"),
    ("--metrics-port", "9100", "9200", lambda c, n: c.metrics_port, 9100, 9200),
    ("--log-format", "console", "json", lambda c, n: c.log_format, "console", "json"),
    ("--log-level", "DEBUG", "warning", lambda c, n: c.log_level, "debug", "warning"),
    ("--drain-timeout-secs", "5", "0", lambda c, n: c.drain_timeout, 5.0, 0.0),
    # The engine's own flags are mirrored the same way.
    ("--transport", "http", "http", lambda c, n: n.transport, "http", "http"),
    ("--http-endpoint", "h:1", "h:2", lambda c, n: n.http_endpoint, "h:1", "h:2"),
    ("--chunk-tokens", "9", "11", lambda c, n: n.chunk_tokens, 9, 11),
]  # fmt: skip


@pytest.mark.parametrize(("flag", "cli", "env", "read", "from_cli", "from_env"), COMMON_FLAGS)
def test_flag_and_its_environment_mirror(
    flag: str, cli: str, env: str, read: object, from_cli: object, from_env: object
) -> None:
    assert callable(read)
    base = [] if flag == "--grpc-endpoint" else ENDPOINT
    var = env_var_for(flag, ENV_PREFIX)
    assert var == "SIDECAR_" + flag[2:].replace("-", "_").upper()
    # The flag alone, the variable alone, and both (the flag wins).
    assert read(*parse([*base, flag, cli])) == from_cli
    assert read(*parse(base, {var: env})) == from_env
    assert read(*parse([*base, flag, cli], {var: env})) == from_cli


def test_endpoint_from_the_environment_satisfies_required() -> None:
    config, _ = parse([], {"SIDECAR_GRPC_ENDPOINT": "engine:50051"})
    assert config.pool.endpoint == Endpoint("engine", 50051)


def test_missing_endpoint_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--grpc-endpoint" in usage_error(capsys, [])


def test_boolean_engine_flag_from_the_environment() -> None:
    assert parse(ENDPOINT, {"SIDECAR_INCREMENTAL": "true"})[1].incremental is True
    assert parse(ENDPOINT, {"SIDECAR_INCREMENTAL": "0"})[1].incremental is False
    assert parse([*ENDPOINT, "--incremental"], {"SIDECAR_INCREMENTAL": "no"})[1].incremental is True


def test_repeatable_engine_flag_from_the_environment() -> None:
    assert parse(ENDPOINT)[1].extra_id is None
    assert parse(ENDPOINT, {"SIDECAR_EXTRA_ID": "7"})[1].extra_id == [7]
    flags = [*ENDPOINT, "--extra-id", "1", "--extra-id", "2"]
    assert parse(flags, {"SIDECAR_EXTRA_ID": "7"})[1].extra_id == [1, 2]


def test_help_shows_each_flags_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for var in (
        "SIDECAR_GRPC_ENDPOINT",
        "SIDECAR_DRAIN_TIMEOUT_SECS",
        "SIDECAR_TRANSPORT",
        "SIDECAR_EXTRA_ID",
    ):
        assert f"[env {var}]" in out


def test_unrelated_variables_are_ignored() -> None:
    config, _ = parse(ENDPOINT, {"SIDECAR_UNKNOWN_THING": "x", "GRPC_CONNECTIONS": "0"})
    assert config.pool.connections == 8


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--grpc-connections", "0"),
        ("--grpc-connections", "-3"),
        ("--grpc-connections", "1.5"),
        ("--grpc-connect-attempt-timeout-secs", "0"),
        ("--grpc-connect-attempt-timeout-secs", "-1"),
        ("--grpc-retry-interval-secs", "0"),
        ("--grpc-startup-deadline-secs", "0"),
        ("--grpc-startup-deadline-secs", "-5"),
        ("--grpc-startup-deadline-secs", "nan"),
        ("--grpc-startup-deadline-secs", "inf"),
        ("--drain-timeout-secs", "-1"),
        ("--metrics-port", "-1"),
        ("--metrics-port", "70000"),
        ("--disaggregation-mode", "both"),
        ("--log-format", "xml"),
        ("--log-level", "loud"),
        ("--listen", "50061"),
        ("--listen", ":50061"),
        ("--listen", "host:port"),
        ("--listen", "::1:50061"),
        ("--listen", "host:70000"),
    ],
)
def test_bad_values_are_usage_errors_naming_the_flag(
    capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    err = usage_error(capsys, [*ENDPOINT, f"{flag}={value}"])
    assert flag in err


@pytest.mark.parametrize(
    "endpoint",
    [
        "",
        "https://x:1",
        "grpcs://x:1",
        "http://user@x:1",
        "x:1/path",
        "x:1?q=1",
        "x",
        "x:notaport",
        "ftp://x:1",
    ],
)
def test_bad_endpoints_are_usage_errors(capsys: pytest.CaptureFixture[str], endpoint: str) -> None:
    err = usage_error(capsys, [f"--grpc-endpoint={endpoint}"])
    assert "--grpc-endpoint" in err


def test_bad_environment_value_names_the_variable(capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(capsys, ENDPOINT, {"SIDECAR_GRPC_CONNECTIONS": "0"})
    assert "SIDECAR_GRPC_CONNECTIONS" in err
    err = usage_error(capsys, [], {"SIDECAR_GRPC_ENDPOINT": "https://x:1"})
    assert "SIDECAR_GRPC_ENDPOINT" in err
    err = usage_error(capsys, ENDPOINT, {"SIDECAR_TRANSPORT": "carrier-pigeon"})
    assert "SIDECAR_TRANSPORT" in err
    err = usage_error(capsys, ENDPOINT, {"SIDECAR_INCREMENTAL": "maybe"})
    assert "SIDECAR_INCREMENTAL" in err


def test_a_flag_overrides_a_bad_variable() -> None:
    config, _ = parse([*ENDPOINT, "--grpc-connections", "2"], {"SIDECAR_GRPC_CONNECTIONS": "zero"})
    assert config.pool.connections == 2


def test_help_lists_common_and_engine_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--grpc-endpoint", "--drain-timeout-secs", "--metrics-port", "--transport", "SIDECAR_"):
        assert flag in out


def test_parser_prog_names_the_engine() -> None:
    assert build_parser(SPEC).prog == "sidecar-fake"
    assert build_parser(SPEC, prog="sidecar fake").prog == "sidecar fake"


@pytest.mark.parametrize(
    ("text", "normal"), [("0.0.0.0:1", "0.0.0.0:1"), ("[::]:80", "[::]:80"), ("h:0", "h:0")]
)
def test_listen_addresses_accepted(text: str, normal: str) -> None:
    assert listen_arg(text) == normal


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("sidecar-fake ")
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("sidecar ")


@pytest.mark.parametrize(("argv", "code"), [([], 2), (["nosuch"], 2), (["--help"], 0), (["-x"], 2)])
def test_sidecar_command_needs_a_known_engine(
    capsys: pytest.CaptureFixture[str], argv: list[str], code: int
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == code
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "vllm" in text
    assert "sglang" in text


# --- logging: what a log shipper receives ---------------------------------------------------


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    ours = {name: logging.getLogger(name).level for name in OUR_LOGGERS}
    config = structlog.get_config()
    try:
        yield
    finally:
        for handler in root.handlers:
            if handler not in handlers:
                root.removeHandler(handler)
        root.setLevel(level)
        for name, old in ours.items():
            logging.getLogger(name).setLevel(old)
        structlog.configure(**config)


@pytest.mark.usefixtures("restore_logging")
def test_json_logs_are_one_object_per_line_with_the_standard_keys() -> None:
    out = io.StringIO()
    configure_logging("json", "info", stream=out)
    structlog.get_logger("sidecar_server.daemon").info("serving", port=50061)
    structlog.get_logger("sidecar_server.daemon").debug("not at info")
    logging.getLogger("grpc._cython.cygrpc").info("library chatter")
    logging.getLogger("grpc._cython.cygrpc").warning("library trouble %d", 7)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        structlog.get_logger("sidecar_server.server").exception("handler crashed")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [line["event"] for line in lines] == ["serving", "library trouble 7", "handler crashed"]
    first = lines[0]
    assert (first["level"], first["logger"], first["port"]) == ("info", "sidecar_server.daemon", 50061)
    stamp = datetime.fromisoformat(first["timestamp"].replace("Z", "+00:00"))
    assert stamp.utcoffset() == timedelta(0)
    assert (lines[1]["level"], lines[1]["logger"]) == ("warning", "grpc._cython.cygrpc")
    assert "RuntimeError: boom" in lines[2]["exception"]


@pytest.mark.usefixtures("restore_logging")
def test_debug_level_shows_our_debug_but_not_library_info() -> None:
    out = io.StringIO()
    configure_logging("json", "debug", stream=out)
    structlog.get_logger("sidecar_vllm.engine").debug("discovered", blocks=16)
    logging.getLogger("aiohttp.access").info("GET /health")
    events = [json.loads(line)["event"] for line in out.getvalue().splitlines()]
    assert events == ["discovered"]


@pytest.mark.usefixtures("restore_logging")
def test_console_format_is_not_json_and_reconfiguring_replaces_the_handler() -> None:
    first, second = io.StringIO(), io.StringIO()
    configure_logging("json", "info", stream=first)
    configure_logging("console", "info", stream=second)
    structlog.get_logger("sidecar_server.daemon").info("serving", port=1)
    assert first.getvalue() == ""
    text = second.getvalue()
    assert "serving" in text
    assert "port=1" in text
    assert not text.lstrip().startswith("{")


def test_default_log_format_follows_the_terminal() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert default_log_format(Tty()) == "console"
    assert default_log_format(io.StringIO()) == "json"


def test_sglang_over_http_needs_no_grpc_endpoint() -> None:
    from sidecar_sglang.__main__ import SPEC as SGLANG

    config, ns = parse_config(
        SGLANG, ["--transport", "http", "--http-endpoint", "127.0.0.1:30000"], {}, log_format_default="json"
    )
    assert ns.transport == "http"
    assert config.pool.endpoint == Endpoint("127.0.0.1", 30000)


def test_sglang_over_grpc_still_requires_the_grpc_endpoint(capsys: pytest.CaptureFixture[str]) -> None:
    from sidecar_sglang.__main__ import SPEC as SGLANG

    with pytest.raises(SystemExit) as exc:
        parse_config(SGLANG, [], {}, log_format_default="json")
    assert exc.value.code == 2
    assert "--grpc-endpoint" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--transport", "http"], "--transport http needs --http-endpoint"),
        (["--http-endpoint", "127.0.0.1:30000"], "--http-endpoint is used only with --transport http"),
    ],
)
def test_sglang_transport_and_http_endpoint_mismatches_say_what_is_wrong(
    capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    from sidecar_sglang.__main__ import SPEC as SGLANG

    with pytest.raises(SystemExit) as exc:
        parse_config(SGLANG, argv, {}, log_format_default="json")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert says in err
    assert "--grpc-endpoint (or" not in err


def test_sglang_http_endpoint_beside_a_grpc_endpoint_needs_transport_http(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from sidecar_sglang.__main__ import SPEC as SGLANG

    argv = ["--http-endpoint", "127.0.0.1:30000", "--grpc-endpoint", "127.0.0.1:30001"]
    with pytest.raises(SystemExit) as exc:
        parse_config(SGLANG, argv, {}, log_format_default="json")
    assert exc.value.code == 2
    assert "--http-endpoint is used only with --transport http" in capsys.readouterr().err


def test_sglang_bad_http_endpoint_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from sidecar_sglang.__main__ import SPEC as SGLANG

    with pytest.raises(SystemExit) as exc:
        parse_config(SGLANG, ["--transport", "http", "--http-endpoint", "https://x:1"], {})
    assert exc.value.code == 2
    assert "--http-endpoint" in capsys.readouterr().err


@pytest.mark.parametrize(("mode", "holds"), [("decode", True), ("prefill", False), ("agg", False)])
def test_decode_mode_turns_on_the_decode_hold_of_the_server(mode: str, holds: bool) -> None:
    from sidecar_server.daemon import _server_config

    config, _ = parse(["--grpc-endpoint", "h:1", "--disaggregation-mode", mode])
    assert _server_config(config).hold_decode_cancels is holds


@pytest.mark.usefixtures("restore_logging")
def test_console_tracebacks_are_plain_without_locals() -> None:
    # rich's renderer printed boxes, source and every local: hundreds of lines per traceback,
    # and whatever the locals held.
    out = io.StringIO()
    configure_logging("console", "info", stream=out)
    try:
        credentials = {"token": "not-for-logs"}
        raise RuntimeError(f"boom with {len(credentials)} credential")
    except RuntimeError:
        structlog.get_logger("sidecar_server.daemon").exception("crash")
    text = out.getvalue()
    assert "Traceback (most recent call last):" in text
    assert "RuntimeError: boom with 1 credential" in text
    assert "not-for-logs" not in text
    assert len(text.splitlines()) < 10


# --- the flag library (sidecar_common.flags) --------------------------------------------------


def test_where_each_value_came_from() -> None:
    from sidecar_common.flags import flag_sources

    _, ns = parse(
        [*ENDPOINT, "--chunk-tokens", "9"], {"SIDECAR_TRANSPORT": "http", "SIDECAR_CHUNK_TOKENS": "7"}
    )
    sources = flag_sources(ns)
    assert (ns.chunk_tokens, ns.transport) == (9, "http")
    assert sources.is_set("chunk_tokens")
    assert "chunk_tokens" not in sources.env  # the flag won
    assert sources.env["transport"] == "SIDECAR_TRANSPORT"
    assert not sources.is_set("incremental")  # a default is not set
    assert sources.option("grpc_endpoint") == "--grpc-endpoint"


@pytest.mark.parametrize(
    ("default", "shown"),
    [(None, "unset"), (True, "on"), (False, "off"), ([], "none"), (("a", "b"), "a,b"), (30.0, "30"),
     (0.5, "0.5"), (8, "8"), ("0.0.0.0:1", "0.0.0.0:1")],
)  # fmt: skip
def test_defaults_as_help_shows_them(default: object, shown: str) -> None:
    from sidecar_common.flags import shown_default

    assert shown_default(default) == shown


def test_a_shared_destination_takes_the_first_flags_default_as_argparse_does() -> None:
    from sidecar_common.flags import FlagParser, parse_with_env

    parser = FlagParser(prog="p")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--incremental", dest="incremental", action="store_true", default=False)
    group.add_argument("--cumulative", dest="incremental", action="store_false")
    assert parse_with_env(parser, [], {}, None).incremental is False
    assert parse_with_env(parser, ["--incremental"], {}, None).incremental is True
    assert parse_with_env(parser, ["--cumulative"], {}, None).incremental is False


def test_a_usage_error_names_only_the_variables_of_flags_it_names(capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(
        capsys,
        ["--grpc-endpoint", "h:1", "--metrics-host", "h"],
        {"SIDECAR_ADVERTISE": "a:1", "SIDECAR_LISTEN": "b:2"},
    )
    # --metrics-host came from the command line: no variable to name; the others are not named.
    assert "--metrics-host needs --metrics-port" in err
    assert "SIDECAR_" not in err


@pytest.mark.parametrize(
    ("lowest", "whole", "text", "value"),
    [
        (1.0, False, "1", 1.0),
        (1.0, False, "2.5", 2.5),
        (0.0, False, "0", 0.0),
        (0, True, "0", 0),
        (0, True, "7", 7),
    ],
)
def test_at_least_arg_takes_numbers_from_its_bound(
    lowest: float, whole: bool, text: str, value: float
) -> None:
    parsed = at_least_arg(lowest, whole=whole)(text)
    assert parsed == value
    assert type(parsed) is (int if whole else float)


@pytest.mark.parametrize(
    ("lowest", "whole", "text"),
    [
        (1.0, False, "0.99"),
        (0.0, False, "-1"),
        (0.0, False, "nan"),
        (0.0, False, "inf"),
        (0.0, False, "x"),
        (0, True, "-1"),
        (0, True, "1.5"),
    ],
)
def test_at_least_arg_refuses_naming_the_bound(lowest: float, whole: bool, text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=f"of {lowest:g} or more, got {text!r}"):
        at_least_arg(lowest, whole=whole)(text)
