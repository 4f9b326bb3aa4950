"""The etcd worker record, prefix, endpoints and advertised address (pure): tables, and a
round-trip property (what a sidecar writes is what a frontend reads)."""

from __future__ import annotations

import json

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from sidecar_common.registration_record import (
    RecordError,
    WorkerRecord,
    advertise_address,
    decode_record,
    encode_record,
    normalize_prefix,
    parse_etcd_endpoints,
    record_key,
)

GOOD = {
    "address": "10.0.0.5:50061",
    "engine": "vllm",
    "model": "llama",
    "role": "decode",
    "data_parallel_size": 2,
}


def body(**changes: object) -> bytes:
    fields = {**GOOD, **changes}
    return json.dumps({k: v for k, v in fields.items() if v is not ...}).encode()


def test_encoding_is_compact_sorted_json_with_every_field() -> None:
    raw = encode_record(WorkerRecord("10.0.0.5:50061", "vllm", "llama", "prefill", 4, "1.2.3"))
    assert raw == (
        b'{"address":"10.0.0.5:50061","data_parallel_size":4,"engine":"vllm",'
        b'"model":"llama","role":"prefill","version":"1.2.3"}'
    )


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (body(), WorkerRecord("10.0.0.5:50061", "vllm", "llama", "decode", 2, "")),
        (
            body(role=..., data_parallel_size=...),
            WorkerRecord("10.0.0.5:50061", "vllm", "llama", "agg", 1, ""),
        ),
        (
            body(version="0.9", extra={"x": 1}),
            WorkerRecord("10.0.0.5:50061", "vllm", "llama", "decode", 2, "0.9"),
        ),
        (body(address="[fd00::5]:50061"), WorkerRecord("[fd00::5]:50061", "vllm", "llama", "decode", 2, "")),
        (
            body(address="worker-0.workers.ns.svc:50061"),
            WorkerRecord("worker-0.workers.ns.svc:50061", "vllm", "llama", "decode", 2, ""),
        ),
    ],
    ids=["full", "defaults", "unknown-fields-ignored", "ipv6", "dns-name"],
)
def test_decode_accepts(raw: bytes, expected: WorkerRecord) -> None:
    assert decode_record(raw) == expected


@pytest.mark.parametrize(
    ("raw", "mentions"),
    [
        (b"not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (body(address=...), "'address'"),
        (body(engine=...), "'engine'"),
        (body(model=None), "'model'"),
        (body(address="10.0.0.5"), "host:port"),
        (body(address="10.0.0.5:0"), "port"),
        (body(address="fd00::5:50061"), "brackets"),
        (body(address="0.0.0.0:50061"), "not dialable"),
        (body(role="leader"), "'role'"),
        (body(data_parallel_size=0), ">= 1"),
        (body(data_parallel_size=True), "'data_parallel_size'"),
        (body(data_parallel_size="2"), "'data_parallel_size'"),
        (body(version=3), "'version'"),
    ],
)
def test_decode_refuses_by_name(raw: bytes, mentions: str) -> None:
    with pytest.raises(RecordError) as caught:
        decode_record(raw)
    assert mentions in str(caught.value)


records = st.builds(
    WorkerRecord,
    address=st.one_of(
        st.ip_addresses(v=4).map(str), st.ip_addresses(v=6).map(lambda a: f"[{a}]"), st.just("w-0.svc")
    ).flatmap(lambda host: st.integers(1, 65535).map(lambda port: f"{host}:{port}")),
    engine=st.sampled_from(["vllm", "sglang"]),
    model=st.text(),
    role=st.sampled_from(["agg", "prefill", "decode"]),
    data_parallel_size=st.integers(1, 1 << 20),
    version=st.text(),
)


@given(records)
def test_what_a_sidecar_writes_a_frontend_reads_back(record: WorkerRecord) -> None:
    assume(not record.address.startswith(("0.0.0.0:", "[::]:")))  # refused on both sides (above)
    assert decode_record(encode_record(record)) == record


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("/llm-sidecars/workers/", "/llm-sidecars/workers/"),
        ("/llm-sidecars/workers", "/llm-sidecars/workers/"),
        (" fleet-a ", "fleet-a/"),
    ],
)
def test_prefix_always_ends_with_a_slash(text: str, expected: str) -> None:
    # Without it, /a/workers would also match the keys of a fleet under /a/workers2.
    assert normalize_prefix(text) == expected


@pytest.mark.parametrize("text", ["", "  ", "/a b/"])
def test_prefix_refusals(text: str) -> None:
    with pytest.raises(RecordError):
        normalize_prefix(text)


def test_key_is_prefix_then_address() -> None:
    assert record_key("/w/", "[fd00::1]:50061") == b"/w/[fd00::1]:50061"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:2379", ("127.0.0.1:2379",)),
        ("http://etcd-0:2379, http://etcd-1:2379/,etcd-0:2379", ("etcd-0:2379", "etcd-1:2379")),
        ("[::1]:2379", ("[::1]:2379",)),
    ],
)
def test_etcd_endpoints(text: str, expected: tuple[str, ...]) -> None:
    assert parse_etcd_endpoints(text) == expected


@pytest.mark.parametrize(
    ("text", "mentions"),
    [
        ("", "at least one"),
        (" , ", "at least one"),
        ("https://etcd:2379", "TLS"),
        ("etcd", "host:port"),
        ("etcd:99999", "port"),
        ("::1:2379", "brackets"),
    ],
)
def test_etcd_endpoint_refusals(text: str, mentions: str) -> None:
    with pytest.raises(RecordError) as caught:
        parse_etcd_endpoints(text)
    assert mentions in str(caught.value)


@pytest.mark.parametrize(
    ("listen", "advertise", "bound", "expected"),
    [
        ("127.0.0.1:0", None, 40123, "127.0.0.1:40123"),  # port 0: the port actually bound
        ("10.1.2.3:50061", None, 50061, "10.1.2.3:50061"),
        ("0.0.0.0:50061", "10.1.2.3:50061", 50061, "10.1.2.3:50061"),
        ("[::]:50061", "[fd00::3]:6000", 50061, "[fd00::3]:6000"),  # advertise wins, port too
        ("0.0.0.0:50061", "worker-0.workers:50061", 50061, "worker-0.workers:50061"),
    ],
)
def test_advertised_address(listen: str, advertise: str | None, bound: int, expected: str) -> None:
    assert advertise_address(listen, advertise, bound) == expected


@pytest.mark.parametrize(
    ("listen", "advertise", "mentions"),
    [
        ("0.0.0.0:50061", None, "--advertise"),
        ("[::]:50061", None, "--advertise"),
        ("10.0.0.1:50061", "0.0.0.0:50061", "dial"),
        ("10.0.0.1:50061", "10.0.0.1", "host:port"),
        ("10.0.0.1:50061", "10.0.0.1:0", "port"),
    ],
)
def test_advertised_address_refusals(listen: str, advertise: str | None, mentions: str) -> None:
    with pytest.raises(RecordError) as caught:
        advertise_address(listen, advertise, 50061)
    assert mentions in str(caught.value)
