"""host:port: the one parser, formatter and wildcard rule; which engine endpoints the sidecar
accepts, and why it refuses the others."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar_common.endpoint import (
    Endpoint,
    EndpointError,
    HostPort,
    HostPortError,
    HostPortProblem,
    HostPortWords,
    format_host_port,
    is_wildcard_host,
    loopback_for,
    parse_bind_host,
    parse_endpoint,
    parse_host_port,
    parse_tcp_endpoint,
)

ACCEPTED = [
    ("127.0.0.1:50051", "127.0.0.1", 50051),
    ("localhost:1", "localhost", 1),
    ("engine.svc.cluster.local:65535", "engine.svc.cluster.local", 65535),
    ("vllm_engine:8000", "vllm_engine", 8000),
    ("grpc://127.0.0.1:50051", "127.0.0.1", 50051),
    ("GRPC://host:7", "host", 7),
    ("http://localhost:30000", "localhost", 30000),
    ("http://localhost:30000/", "localhost", 30000),
    ("[::1]:50051", "::1", 50051),
    ("grpc://[fe80::1]:9", "fe80::1", 9),
    ("http://[2001:db8::2]:443", "2001:db8::2", 443),
    ("  10.0.0.2:50051\n", "10.0.0.2", 50051),
]


@pytest.mark.parametrize(("text", "host", "port"), ACCEPTED)
def test_accepted_forms(text: str, host: str, port: int) -> None:
    assert parse_endpoint(text) == Endpoint(host, port)


REFUSED = [
    ("", "empty"),
    ("   ", "empty"),
    ("https://host:443", "TLS is not supported yet"),
    ("grpcs://host:443", "TLS is not supported yet"),
    ("unix:///tmp/sock", "unsupported scheme unix://"),
    ("dns:///host:1", "unsupported scheme dns://"),
    ("://host:1", "unsupported scheme an empty scheme"),
    ("http://user@host:1", "user info"),
    ("grpc://user:pw@host:1", "user info"),
    ("http://host:1/generate", "a path ('/generate')"),
    ("host:1//", "a path"),
    ("http://host:1?x=1", "a query"),
    ("http://host:1#frag", "a fragment"),
    ("host", "port is missing"),
    ("host:", "port is missing"),
    ("grpc://host", "port is missing"),
    ("[::1]", "port is missing"),
    ("host:http", "not a number"),
    ("host:-1", "not a number"),
    ("host:+1", "not a number"),
    ("host:0", "out of range"),
    ("host:65536", "out of range"),
    ("host:123456", "not a number"),
    ("::1:50051", "must be in brackets"),
    ("2001:db8::1", "must be in brackets"),
    ("[::1:50051", "no closing ']'"),
    ("[not-ipv6]:1", "not an IPv6 address"),
    ("[::1]50051", "expected :port"),
    (":50051", "host is missing"),
    ("grpc://", "host is missing"),
    ("bad host:1", "not a valid host name"),
    ("-host:1", "not a valid host name"),
    ("ho%st:1", "not a valid host name"),
    ("999.1.1.1:1", "not a valid IPv4 address"),
    ("10.0.0:1", "not a valid IPv4 address"),
    ("host:1\n2", "not a number"),
]


@pytest.mark.parametrize(("text", "why"), REFUSED)
def test_refused_forms_say_why(text: str, why: str) -> None:
    with pytest.raises(EndpointError) as info:
        parse_endpoint(text)
    assert why in str(info.value)
    assert isinstance(info.value, ValueError)


def test_target_and_url_bracket_ipv6() -> None:
    assert parse_endpoint("[::1]:5").target == "[::1]:5"
    assert parse_endpoint("http://[::1]:5").http_base_url == "http://[::1]:5"
    assert parse_endpoint("grpc://h:5").target == "h:5"
    assert str(parse_endpoint("h:5")) == "h:5"


@pytest.mark.parametrize(
    ("host", "port", "address"),
    [("10.0.0.1", 50061, "10.0.0.1:50061"), ("fd00::1", 1, "[fd00::1]:1"), ("[fd00::1]", 1, "[fd00::1]:1")],
)
def test_format_host_port_brackets_ipv6_once(host: str, port: int, address: str) -> None:
    assert format_host_port(host, port) == address


@pytest.mark.parametrize(
    ("host", "wildcard"),
    [
        ("", True),
        ("  ", True),
        ("0.0.0.0", True),
        ("::", True),
        ("[::]", True),
        ("[0:0:0:0:0:0:0:0]", True),
        ("::0", True),
        ("*", True),  # ZeroMQ's spelling
        ("127.0.0.1", False),
        ("::1", False),
        ("[fd00::1]", False),
        ("localhost", False),
        ("0.0.0.1", False),
    ],
)
def test_one_wildcard_rule(host: str, wildcard: bool) -> None:
    assert is_wildcard_host(host) is wildcard


@pytest.mark.parametrize(
    ("host", "dialled"),
    [
        ("*", "127.0.0.1"),
        ("0.0.0.0", "127.0.0.1"),
        ("", "127.0.0.1"),
        ("::", "::1"),
        ("[::]", "::1"),
        ("[0:0:0:0:0:0:0:0]", "::1"),
        ("10.0.0.2", "10.0.0.2"),
        ("[fd00::1]", "fd00::1"),
        ("engine", "engine"),
    ],
)
def test_a_wildcard_is_dialled_on_the_loopback_of_its_family(host: str, dialled: str) -> None:
    assert loopback_for(host) == dialled


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("tcp://*:5557", HostPort("*", 5557)),
        ("tcp://0.0.0.0:1", HostPort("0.0.0.0", 1)),
        ("tcp://[::1]:5557", HostPort("::1", 5557)),
        ("tcp://engine_0:65535", HostPort("engine_0", 65535)),
        (" tcp://h:2\n", HostPort("h", 2)),
    ],
)
def test_zeromq_tcp_addresses(text: str, address: HostPort) -> None:
    assert parse_tcp_endpoint(text) == address


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("ipc:///tmp/x", "expected tcp://HOST:PORT"),
        ("TCP://h:1", "expected tcp://HOST:PORT"),  # ZeroMQ reads the scheme as written
        ("h:1", "expected tcp://HOST:PORT"),
        ("tcp://h:0", "port 0 cannot be dialled"),
        ("tcp://*:", "the port is missing"),
        ("tcp://**:1", "'**' is not a valid host name or IPv4 address"),
        ("tcp://::1:1", "an IPv6 address must be in brackets"),
        ("tcp://h:99999", "port 99999 is out of range (1..65535)"),
    ],
)
def test_zeromq_tcp_refusals_say_why(text: str, why: str) -> None:
    with pytest.raises(EndpointError) as info:
        parse_tcp_endpoint(text)
    assert str(info.value).startswith(f"invalid endpoint {text!r}: {why}")


def test_port_zero_only_where_allowed() -> None:
    assert parse_host_port("h:0", port_zero_allowed=True) == HostPort("h", 0)
    with pytest.raises(HostPortError) as info:
        parse_host_port("h:0", port_zero_allowed=False)
    assert info.value.problem is HostPortProblem.PORT_OUT_OF_RANGE


@pytest.mark.parametrize(
    ("text", "problem", "detail"),
    [
        ("", HostPortProblem.NO_HOST, ""),
        (":1", HostPortProblem.NO_HOST, ""),
        ("host", HostPortProblem.NO_PORT, "host"),
        ("[::1]", HostPortProblem.NO_PORT, "::1"),
        ("host:", HostPortProblem.EMPTY_PORT, ""),
        ("[::1:5", HostPortProblem.UNCLOSED_BRACKET, "[::1:5"),
        ("[::1]x:5", HostPortProblem.AFTER_BRACKETS, "x:5"),
        ("[]:5", HostPortProblem.NOT_IPV6_IN_BRACKETS, ""),
        ("[h]:5", HostPortProblem.NOT_IPV6_IN_BRACKETS, "h"),
        ("fd00::1:5", HostPortProblem.IPV6_UNBRACKETED, "fd00::1:5"),
        ("a b:5", HostPortProblem.BAD_HOST_NAME, "a b"),
        ("a,b:5", HostPortProblem.BAD_HOST_NAME, "a,b"),
        ("a]:5", HostPortProblem.BAD_HOST_NAME, "a]"),
        ("1.2.3:5", HostPortProblem.BAD_IPV4, "1.2.3"),
        ("h:x", HostPortProblem.PORT_NOT_NUMBER, "x"),
        ("h:+5", HostPortProblem.PORT_NOT_NUMBER, "+5"),
        ("h:70000", HostPortProblem.PORT_OUT_OF_RANGE, "70000"),
    ],
)
def test_host_port_refusals_name_the_problem(text: str, problem: HostPortProblem, detail: str) -> None:
    with pytest.raises(HostPortError) as info:
        parse_host_port(text, port_zero_allowed=True)
    assert (info.value.problem, info.value.text, info.value.detail) == (problem, text, detail)


def test_each_caller_words_the_problem() -> None:
    words = HostPortWords(
        not_host_port="shape {text!r}",
        brackets="brackets {text!r}",
        unbracketed_ipv6="v6 {text!r}",
        bad_host="host {detail!r}",
        bad_port="port {detail!r}",
        port_out_of_range="range {detail}",
    )
    said = {}
    for text in ("h", "[::1", "::1:5", "a b:5", "h:x", "h:0"):
        with pytest.raises(HostPortError) as info:
            parse_host_port(text, port_zero_allowed=False)
        said[text] = words.message(info.value)
    assert said == {
        "h": "shape 'h'",
        "[::1": "brackets '[::1'",
        "::1:5": "v6 '::1:5'",
        "a b:5": "host 'a b'",
        "h:x": "port 'x'",
        "h:0": "range 0",
    }


@pytest.mark.parametrize(("text", "host"), [("::1", "::1"), ("[::1]", "::1"), (" h.local ", "h.local")])
def test_bind_hosts(text: str, host: str) -> None:
    assert parse_bind_host(text) == host


@pytest.mark.parametrize("text", ["", "[::1", "[h]", "a b", "h:1", "1.2.3"])
def test_bind_host_refusals(text: str) -> None:
    with pytest.raises(HostPortError):
        parse_bind_host(text)


hosts = st.one_of(
    st.ip_addresses(v=4).map(str),
    st.ip_addresses(v=6).map(str),
    st.from_regex(r"[a-z][a-z0-9-]{0,10}[a-z0-9](\.[a-z][a-z0-9]{0,5}){0,3}", fullmatch=True),
)


@given(hosts, st.integers(0, 65535))
def test_what_the_formatter_writes_the_parser_reads(host: str, port: int) -> None:
    assert parse_host_port(format_host_port(host, port), port_zero_allowed=True) == HostPort(host, port)
