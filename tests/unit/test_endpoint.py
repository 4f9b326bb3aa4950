"""Which engine endpoints the sidecar accepts, and why it refuses the others."""

from __future__ import annotations

import pytest

from sidecar_common.endpoint import Endpoint, EndpointError, parse_endpoint

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
