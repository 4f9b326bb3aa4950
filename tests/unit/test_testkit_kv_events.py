"""The testkit's KV-event wire, pure: the flag as each engine reads it, endpoint rules, the
replay buffer's answers, and each engine's encoding (decoded with tests/kv_events_mirror.py)."""

from __future__ import annotations

import msgspec
import pytest
from testkit.kv_events import (
    END_SEQ,
    KvEventsConfig,
    ReplayBuffer,
    binds,
    encode_batch,
    offset_endpoint,
    parse_kv_events_config,
    sglang_kv_events_descriptor,
)
from testkit.prefix_cache import BlockExtra, Cleared, Removed, Stored

from tests.kv_events_mirror import (
    SglangBatch,
    SglangCleared,
    SglangRemoved,
    SglangStored,
    VllmBatch,
    VllmCleared,
    VllmRemoved,
    VllmStored,
)


@pytest.mark.parametrize(
    ("flavor", "text", "publisher"),
    [
        ("vllm", '{"enable_kv_cache_events": true}', "zmq"),
        ("vllm", '{"enable_kv_cache_events": true, "publisher": "null"}', "null"),
        ("vllm", '{"publisher": "zmq"}', "null"),  # events disabled: vLLM makes no publisher
        ("vllm", "{}", "null"),
        ("sglang", '{"publisher": "zmq"}', "zmq"),
        ("sglang", "{}", "null"),
    ],
)
def test_the_publisher_each_engine_makes_of_the_flag(flavor: str, text: str, publisher: str) -> None:
    assert parse_kv_events_config(text, flavor).publisher == publisher  # type: ignore[arg-type]


def test_the_flags_fields_and_defaults() -> None:
    text = '{"publisher": "zmq", "endpoint": "tcp://*:6000", "replay_endpoint": "tcp://*:6001", '
    text += '"topic": "kv", "buffer_steps": 5, "hwm": 10, "max_queue_size": 7, "bind": true}'
    assert parse_kv_events_config(text, "sglang") == KvEventsConfig(
        publisher="zmq",
        endpoint="tcp://*:6000",
        replay_endpoint="tcp://*:6001",
        buffer_steps=5,
        hwm=10,
        max_queue_size=7,
        topic="kv",
        bind=True,
    )
    assert parse_kv_events_config('{"enable_kv_cache_events": true}', "vllm") == KvEventsConfig(
        publisher="zmq"
    )


@pytest.mark.parametrize(
    ("flavor", "text", "why"),
    [
        ("vllm", "[]", "JSON object"),
        ("vllm", "{", "not JSON"),
        ("vllm", '{"bind": true}', "unknown field(s) bind"),  # SGLang's only
        ("sglang", '{"enable_kv_cache_events": true}', "unknown field(s) enable_kv_cache_events"),
        ("sglang", '{"publisher": "kafka"}', "unknown publisher"),
        ("sglang", '{"format": "dynamo"}', "default format only"),
        ("vllm", '{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps"),
    ],
)
def test_a_bad_flag_is_refused_with_the_reason(flavor: str, text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why.replace("(", r"\(").replace(")", r"\)")):
        parse_kv_events_config(text, flavor)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("endpoint", "rank", "vllm", "sglang"),
    [
        ("tcp://*:5557", 0, "tcp://*:5557", "tcp://*:5557"),
        ("tcp://*:5557", 2, "tcp://*:5559", "tcp://*:5559"),
        ("tcp://*:0", 1, "tcp://*:0", "tcp://*:1"),  # vLLM leaves port 0 alone; SGLang does not
        ("tcp://host:7000", 3, "tcp://host:7003", "tcp://host:7003"),
        ("inproc://kv", 1, "inproc://kv_dp1", "inproc://kv_dp1"),
        (None, 1, None, None),
    ],
)
def test_data_parallel_ranks_offset_the_port(
    endpoint: str | None, rank: int, vllm: str | None, sglang: str | None
) -> None:
    assert offset_endpoint(endpoint, rank, "vllm") == vllm
    assert offset_endpoint(endpoint, rank, "sglang") == sglang


def test_an_endpoint_neither_tcp_nor_inproc_is_refused_for_a_rank() -> None:
    with pytest.raises(ValueError, match="tcp or inproc"):
        offset_endpoint("ipc:///tmp/kv", 1, "vllm")


@pytest.mark.parametrize(
    ("endpoint", "bind", "vllm", "sglang"),
    [
        ("tcp://*:5557", None, True, True),
        ("tcp://[::]:5557", None, True, True),
        ("tcp://0.0.0.0:5557", None, False, True),  # SGLang binds 0.0.0.0 too
        ("tcp://127.0.0.1:5557", None, False, False),
        ("tcp://127.0.0.1:5557", True, False, True),  # SGLang's "bind" decides; vLLM has none
        ("tcp://*:5557", False, True, False),
        ("ipc:///tmp/kv", None, True, True),
        ("inproc://kv", None, True, True),
    ],
)
def test_bind_for_wildcards_connect_otherwise(
    endpoint: str, bind: bool | None, vllm: bool, sglang: bool
) -> None:
    assert binds(endpoint, "vllm", bind) is vllm
    assert binds(endpoint, "sglang", bind) is sglang


def test_replay_answers_from_the_start_or_the_oldest_kept_then_the_end_marker() -> None:
    buffer = ReplayBuffer(3)
    for seq in range(5):
        buffer.append(seq, f"p{seq}".encode())
    start = (3).to_bytes(8, "big")
    assert buffer.answer(b"id", [b"", start], b"t") == [
        [b"id", b"", b"t", (3).to_bytes(8, "big"), b"p3"],
        [b"id", b"", b"t", (4).to_bytes(8, "big"), b"p4"],
        [b"id", b"", b"", END_SEQ, b""],
    ]
    oldest = buffer.answer(b"id", [b"", (0).to_bytes(8, "big")], b"t")
    assert oldest is not None
    assert [int.from_bytes(r[3], "big", signed=True) for r in oldest] == [2, 3, 4, -1]
    assert buffer.answer(b"id", [b"", (9).to_bytes(8, "big")], b"t") == [[b"id", b"", b"", END_SEQ, b""]]
    assert buffer.answer(b"id", [start], b"t") is None  # a REQ-less malformed request


STORED = Stored(
    block_hashes=(11, 12),
    parent_hash=None,
    token_ids=(1, 2, 3, 4),
    block_size=2,
    extra=BlockExtra(lora_name="ad", cache_salt="salt"),
    first_block_index=0,
)


def test_vllms_encoding() -> None:
    payload = encode_batch("vllm", 1.5, [STORED, Removed((12, 11)), Cleared()], 0)
    batch = msgspec.msgpack.decode(payload, type=VllmBatch)
    assert batch.data_parallel_rank == 0
    stored, removed_a, removed_b, cleared = batch.events
    assert isinstance(stored, VllmStored)
    assert stored.block_hashes == [11, 12]
    assert stored.token_ids == [1, 2, 3, 4]
    assert stored.lora_name == "ad"
    assert stored.lora_id is not None
    # LoRA name on every block, the salt on the prompt's first block only; untagged.
    assert stored.extra_keys == [("ad", "salt"), ("ad",)]
    assert stored.group_idx == 0
    assert stored.medium == "GPU"
    assert [removed_a, removed_b] == [  # one removal per block
        VllmRemoved(block_hashes=[12], medium="GPU", group_idx=0),
        VllmRemoved(block_hashes=[11], medium="GPU", group_idx=0),
    ]
    assert isinstance(cleared, VllmCleared)
    ts, events, rank = msgspec.msgpack.decode(payload)
    assert (ts, rank) == (1.5, 0)
    assert events[3] == {"type": "AllBlocksCleared"}


def test_sglangs_encoding() -> None:
    later = Stored((13,), 12, (5, 6), 2, BlockExtra(cache_salt="salt"), first_block_index=2)
    payload = encode_batch("sglang", 2.5, [Removed((1,)), Removed((2,)), STORED, later, Cleared()], 3)
    batch = msgspec.msgpack.decode(payload, type=SglangBatch)
    assert batch.attn_dp_rank == 3
    removed, stored, stored_later, cleared = batch.events
    assert removed == SglangRemoved(block_hashes=[1, 2], medium="GPU")  # consecutive removals merge
    assert isinstance(stored, SglangStored)
    assert stored.cache_salt == "salt"
    assert stored.lora_id is None
    assert stored.lora_name == "ad"
    assert isinstance(stored_later, SglangStored)
    assert stored_later.parent_block_hash == 12
    assert isinstance(cleared, SglangCleared)
    raw = msgspec.msgpack.decode(payload)
    assert list(raw[1][1]) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "cache_salt",
        "lora_name",
    ]
    # SGLang's batch always has its three elements; vLLM's omits a None rank.
    assert len(msgspec.msgpack.decode(encode_batch("sglang", 0.0, [Cleared()], 0))) == 3


@pytest.mark.parametrize(
    ("text", "endpoint", "replay", "expected"),
    [
        ('{"publisher": "zmq"}', "tcp://*:5557", None, {"endpoint_host": "*", "endpoint_port_base": 5557}),
        (
            '{"publisher": "zmq", "topic": "t"}',
            "tcp://10.0.0.1:6000",
            "tcp://*:6001",
            {
                "endpoint_host": "10.0.0.1",
                "endpoint_port_base": 6000,
                "topic": "t",
                "replay_endpoint_port_base": 6001,
            },
        ),
        (
            '{"publisher": "zmq"}',
            "tcp://*:5557",
            "ipc:///tmp/r",
            {"endpoint_host": "*", "endpoint_port_base": 5557},
        ),
        ('{"publisher": "zmq"}', "ipc:///tmp/kv", None, None),  # not routable
        ('{"publisher": "zmq"}', "tcp://*:0", None, None),  # no port to advertise
        ('{"publisher": "null"}', "tcp://*:5557", None, None),
    ],
)
def test_sglangs_server_info_descriptor(
    text: str, endpoint: str, replay: str | None, expected: dict[str, object] | None
) -> None:
    config = parse_kv_events_config(text, "sglang")
    got = sglang_kv_events_descriptor(config, endpoint, replay, 16, 2)
    if expected is None:
        assert got is None
    else:
        assert got == {"publisher": "zmq", "topic": "", "block_size": 16, "dp_size": 2, **expected}


def test_the_engines_command_lines_take_the_flags() -> None:
    from testkit.__main__ import add_vllm_arguments, vllm_config_from_args
    from testkit.sglang_cli import add_arguments, config_from_args

    from sidecar_common.flags import FlagParser

    vllm = FlagParser(prog="t")
    add_vllm_arguments(vllm)
    v = vllm_config_from_args(
        vllm.parse_args(
            [
                "--block-size=32",
                "--num-gpu-blocks-override=100",
                "--prefill-us-per-token=2.5",
                '--kv-events-config={"enable_kv_cache_events": true, "topic": "kv"}',
            ]
        )
    )
    assert (v.block_size, v.num_gpu_blocks, v.prefill_us_per_token) == (32, 100, 2.5)
    assert v.kv_events == KvEventsConfig(publisher="zmq", topic="kv")
    sglang = FlagParser(prog="t")
    add_arguments(sglang)
    g = config_from_args(
        sglang.parse_args(
            [
                "--page-size=4",
                "--max-total-tokens=64",
                '--kv-events-config={"publisher": "zmq", "bind": true}',
            ]
        )
    )
    assert (g.page_size, g.kv_capacity_tokens, g.prefill_us_per_token) == (4, 64, 0.0)
    assert g.kv_events == KvEventsConfig(publisher="zmq", bind=True)
    with pytest.raises(SystemExit):
        sglang.parse_args(['--kv-events-config={"publisher": "kafka"}'])
