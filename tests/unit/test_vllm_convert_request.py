"""PreprocessedRequest -> vLLM GenerateRequest: every field, every refusal (docs/vllm.md)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from google.protobuf import struct_pb2
from hypothesis import given
from hypothesis import strategies as st
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2

from sidecar_common.api import sidecar_pb2
from sidecar_common.disaggregation import DisaggregationMode
from sidecar_common.errors import FailureReason, SidecarError
from sidecar_vllm.convert import to_generate_request, wire_seed

Req = sidecar_pb2.PreprocessedRequest
Mutate = Callable[[Req], None]


def make(mutate: Mutate | None = None, **kw: Any) -> Req:
    req = Req(request_id="pub", token_ids=[1, 2, 3], **kw)
    if mutate is not None:
        mutate(req)
    return req


def convert(
    req: Req, mode: DisaggregationMode = "agg", vision: bool = False
) -> vllm_engine_pb2.GenerateRequest:
    return to_generate_request(req, "priv-1", mode=mode, supports_vision=vision)


def struct(obj: dict[str, Any]) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(obj)
    return s


def refused(req: Req, field: str, mode: DisaggregationMode = "agg", vision: bool = False) -> str:
    with pytest.raises(SidecarError) as info:
        convert(req, mode, vision)
    assert info.value.reason is FailureReason.INVALID_ARGUMENT
    assert info.value.message.startswith(field), info.value.message
    return info.value.message


# ---------------------------------------------------------------- defaults and identity


def test_minimal_request_uses_private_id_tokens_stream_and_neutral_values() -> None:
    native = convert(make())
    assert native.request_id == "priv-1"
    assert list(native.tokenized.input_ids) == [1, 2, 3]
    assert native.stream is True
    p = native.sampling_params
    assert not p.HasField("temperature")
    assert not p.HasField("seed")
    assert not p.HasField("max_tokens")
    assert not p.HasField("logprobs")
    assert not p.HasField("prompt_logprobs")
    assert p.WhichOneof("constraint") is None
    assert (p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0, 0.0)
    assert p.repetition_penalty == 1.0
    assert p.top_k == 0
    assert p.n == 1
    assert p.min_tokens == 0
    assert p.skip_special_tokens is True
    assert p.ignore_eos is False
    assert p.include_stop_str_in_output is False
    assert not native.HasField("data_parallel_rank")
    assert not native.HasField("kv_transfer_params_json")
    assert not native.HasField("media_refs")


# ------------------------------------------------------------------ sampling, one by one


@pytest.mark.parametrize(
    ("field", "value", "wire_field", "expected"),
    [
        ("temperature", 0.0, "temperature", 0.0),
        ("temperature", 0.7, "temperature", pytest.approx(0.7)),
        ("top_p", 0.5, "top_p", 0.5),
        ("min_p", 0.0, "min_p", 0.0),
        ("min_p", 0.25, "min_p", 0.25),
        ("presence_penalty", 0.5, "presence_penalty", 0.5),
        ("frequency_penalty", -0.5, "frequency_penalty", -0.5),
        ("repetition_penalty", 1.5, "repetition_penalty", 1.5),
        ("length_penalty", 1.0, None, None),
        ("top_k", -1, "top_k", 0),
        ("top_k", 0, "top_k", 0),
        ("top_k", 40, "top_k", 40),
        ("seed", 0, "seed", 0),
        ("seed", -(2**31), "seed", -(2**31)),
        ("seed", 2**31 - 1, "seed", 2**31 - 1),
        # Unsigned 32-bit seeds: the same 32 bits, read signed.
        ("seed", 2**31, "seed", -(2**31)),
        ("seed", 3_000_000_000, "seed", 3_000_000_000 - 2**32),
        ("seed", 2**32 - 1, "seed", -1),
        ("n", 1, "n", 1),
        ("n", 3, "n", 3),
        ("best_of", 1, None, None),
        ("use_beam_search", False, None, None),
        ("include_stop_str_in_output", True, "include_stop_str_in_output", True),
        ("include_stop_str_in_output", False, "include_stop_str_in_output", False),
    ],
)
def test_sampling_option_is_carried(field: str, value: Any, wire_field: str | None, expected: Any) -> None:
    req = make()
    setattr(req.sampling_options, field, value)
    p = convert(req).sampling_params
    if wire_field is not None:
        if wire_field in ("temperature", "seed"):
            assert p.HasField(wire_field), "an explicit value keeps its presence"
        assert getattr(p, wire_field) == expected


@pytest.mark.parametrize(
    ("field", "value", "name"),
    [
        ("best_of", 2, "sampling_options.best_of"),
        ("best_of", 0, "sampling_options.best_of"),
        ("use_beam_search", True, "sampling_options.use_beam_search"),
        ("length_penalty", 0.5, "sampling_options.length_penalty"),
        ("seed", 2**32, "sampling_options.seed"),
        ("seed", 2**63 - 1, "sampling_options.seed"),
        ("seed", -(2**31) - 1, "sampling_options.seed"),
        ("top_k", -2, "sampling_options.top_k"),
        ("top_p", 0.0, "sampling_options.top_p"),
        ("repetition_penalty", 0.0, "sampling_options.repetition_penalty"),
        ("n", 0, "sampling_options.n"),
        ("n", 1025, "sampling_options.n"),
        ("n", 2**32 - 1, "sampling_options.n"),
    ],
)
def test_sampling_option_is_refused(field: str, value: Any, name: str) -> None:
    req = make()
    setattr(req.sampling_options, field, value)
    refused(req, name)


def test_n_up_to_the_bound_is_carried() -> None:
    req = make()
    req.sampling_options.n = 1024
    assert convert(req).sampling_params.n == 1024


def test_logit_bias_is_carried_and_keys_beyond_int32_refused() -> None:
    req = make()
    req.sampling_options.logit_bias[7] = -100.0
    req.sampling_options.logit_bias[2**31 - 1] = 5.0
    assert dict(convert(req).sampling_params.logit_bias) == {7: -100.0, 2**31 - 1: 5.0}
    req.sampling_options.logit_bias[2**31] = 1.0
    refused(req, "sampling_options.logit_bias")


# ------------------------------------------------------------------------ stop conditions


def test_max_and_min_tokens() -> None:
    req = make()
    req.stop_conditions.max_tokens = 4
    req.stop_conditions.min_tokens = 4
    p = convert(req).sampling_params
    assert p.HasField("max_tokens")
    assert p.max_tokens == 4
    assert p.min_tokens == 4


def test_stop_strings_are_carried_in_order() -> None:
    req = make()
    req.stop_conditions.stop.extend(["\n\n", "END"])
    assert list(convert(req).sampling_params.stop) == ["\n\n", "END"]


def test_stop_token_ids_are_the_sorted_deduplicated_union_of_user_and_hidden() -> None:
    req = make()
    req.stop_conditions.stop_token_ids.extend([9, 3, 9])
    req.stop_conditions.stop_token_ids_hidden.extend([2, 3])
    assert list(convert(req).sampling_params.stop_token_ids) == [2, 3, 9]


def test_ignore_eos_leaves_the_hidden_stops_out() -> None:
    req = make()
    req.stop_conditions.stop_token_ids.extend([9])
    req.stop_conditions.stop_token_ids_hidden.extend([2])
    req.stop_conditions.ignore_eos = True
    p = convert(req).sampling_params
    assert p.ignore_eos is True
    assert list(p.stop_token_ids) == [9]


def test_ignore_eos_false_keeps_hidden_stops() -> None:
    req = make()
    req.stop_conditions.stop_token_ids_hidden.extend([2])
    req.stop_conditions.ignore_eos = False
    assert list(convert(req).sampling_params.stop_token_ids) == [2]


# ------------------------------------------------------------------------ output options


@pytest.mark.parametrize("value", [0, 1, 20, 2**31 - 1])
def test_logprobs_and_prompt_logprobs_are_carried_with_presence(value: int) -> None:
    req = make()
    req.output_options.logprobs = value
    req.output_options.prompt_logprobs = value
    p = convert(req).sampling_params
    assert p.HasField("logprobs")
    assert p.HasField("prompt_logprobs")
    assert (p.logprobs, p.prompt_logprobs) == (value, value)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_logprobs_beyond_int32_refused(field: str) -> None:
    req = make()
    setattr(req.output_options, field, 2**31)
    refused(req, f"output_options.{field}")


@pytest.mark.parametrize(("given", "sent"), [(None, True), (True, True), (False, False)])
def test_skip_special_tokens(given: bool | None, sent: bool) -> None:
    req = make()
    if given is not None:
        req.output_options.skip_special_tokens = given
    assert convert(req).sampling_params.skip_special_tokens is sent


# ------------------------------------------------------------------------ guided decoding


def test_guided_json_is_sent_as_compact_text() -> None:
    req = make()
    req.sampling_options.guided_decoding.json = '{ "type" : "object",\n "required": [ "a" ] }'
    p = convert(req).sampling_params
    assert p.WhichOneof("constraint") == "json_schema"
    assert p.json_schema == '{"type":"object","required":["a"]}'


@pytest.mark.parametrize(
    ("kind", "value", "wire"),
    [
        ("regex", "[a-z]+", "regex"),
        ("grammar", "root ::= 'a'", "grammar"),
        ("structural_tag", "{}", "structural_tag"),
    ],
)
def test_guided_string_constraints(kind: str, value: str, wire: str) -> None:
    req = make()
    setattr(req.sampling_options.guided_decoding, kind, value)
    p = convert(req).sampling_params
    assert p.WhichOneof("constraint") == wire
    assert getattr(p, wire) == value


def test_guided_choice() -> None:
    req = make()
    req.sampling_options.guided_decoding.choice.choices.extend(["yes", "no"])
    p = convert(req).sampling_params
    assert p.WhichOneof("constraint") == "choice"
    assert list(p.choice.choices) == ["yes", "no"]


@pytest.mark.parametrize(
    ("mutate", "name"),
    [
        (lambda g: setattr(g, "json", "{not json"), "sampling_options.guided_decoding.json"),
        (lambda g: setattr(g, "json", '{"maximum": NaN}'), "sampling_options.guided_decoding.json"),
        (lambda g: setattr(g, "json", "[" * 100_000), "sampling_options.guided_decoding.json"),
        (lambda g: g.choice.SetInParent(), "sampling_options.guided_decoding.choice"),
        (lambda g: setattr(g, "backend", "xgrammar"), "sampling_options.guided_decoding.backend"),
        (lambda g: setattr(g, "backend", ""), "sampling_options.guided_decoding.backend"),
        (
            lambda g: setattr(g, "whitespace_pattern", " "),
            "sampling_options.guided_decoding.whitespace_pattern",
        ),
    ],
)
def test_guided_refusals(mutate: Callable[[sidecar_pb2.GuidedDecoding], None], name: str) -> None:
    req = make()
    req.sampling_options.guided_decoding.regex = "a"
    mutate(req.sampling_options.guided_decoding)
    refused(req, name)


def test_two_guided_constraints_cannot_be_expressed_on_the_public_wire() -> None:
    # The public proto makes the constraints a oneof: the last one set wins at the source.
    g = sidecar_pb2.GuidedDecoding(regex="a")
    g.grammar = "b"
    assert g.WhichOneof("kind") == "grammar"


# -------------------------------------------------------------------------- refusals


def test_empty_prompt_refused() -> None:
    refused(Req(request_id="x"), "token_ids")


@pytest.mark.parametrize(
    ("mutate", "name"),
    [
        (lambda r: setattr(r.routing, "lora_name", "adapter"), "routing.lora_name"),
        (lambda r: setattr(r.routing, "cache_namespace", "tenant"), "routing.cache_namespace"),
        (lambda r: setattr(r.routing, "priority", 5), "routing.priority"),
        (lambda r: setattr(r.routing, "priority", -1), "routing.priority"),
        (lambda r: setattr(r.bootstrap_info, "bootstrap_room", 3), "bootstrap_info"),
        (lambda r: r.extra_args.update({"mystery": 1}), "extra_args.mystery"),
        (lambda r: r.extra_args.update({"kv_transfer_params": 5}), "extra_args.kv_transfer_params"),
        (lambda r: r.prefill_result.disaggregated_params.update({"a": 1}), "prefill_result"),
        (lambda r: r.routing.__setattr__("dp_rank", 2**31), "routing.dp_rank"),
    ],
)
def test_request_refusals(mutate: Mutate, name: str) -> None:
    refused(make(mutate), name)


def test_default_valued_hints_are_accepted() -> None:
    def hints(r: Req) -> None:
        r.routing.lora_name = ""
        r.routing.cache_namespace = ""
        r.routing.priority = 0

    convert(make(hints))


def test_unknown_extra_args_are_named_even_beside_a_known_one() -> None:
    def extra(r: Req) -> None:
        r.extra_args.update({"kv_transfer_params": {}, "zeta": 1, "alpha": 2})

    refused(make(extra), "extra_args.alpha")


# ------------------------------------------------------------------------------ media


def _media(r: Req) -> None:
    r.multi_modal_data.add(kind=sidecar_pb2.MultimodalItem.IMAGE, url="https://x/cat.png")
    r.multi_modal_data.add(kind=sidecar_pb2.MultimodalItem.VIDEO, url="data:video/mp4;base64,AAAA")


def test_media_on_a_text_model_refused() -> None:
    refused(make(_media), "multi_modal_data", vision=False)


def test_media_on_a_vision_model_sent_as_references_in_order() -> None:
    native = convert(make(_media), vision=True)
    items = native.media_refs.items
    assert [(i.modality, i.url) for i in items] == [
        (common_pb2.IMAGE, "https://x/cat.png"),
        (common_pb2.VIDEO, "data:video/mp4;base64,AAAA"),
    ]


@pytest.mark.parametrize(
    "kind", [sidecar_pb2.MultimodalItem.AUDIO, sidecar_pb2.MultimodalItem.KIND_UNSPECIFIED]
)
def test_media_kinds_the_wire_cannot_carry_refused(kind: int) -> None:
    req = make()
    req.multi_modal_data.add(kind=kind, url="https://x/a")
    refused(req, "multi_modal_data[0].kind", vision=True)


# --------------------------------------------------------------- data-parallel rank


@pytest.mark.parametrize(
    ("mode", "dp", "prefill_dp", "sent"),
    [
        ("agg", None, None, None),
        ("agg", 0, None, 0),
        ("agg", 3, 1, 3),
        ("decode", 2, 1, 2),
        ("prefill", 2, 1, 1),
        ("prefill", 2, None, 2),
        ("prefill", None, 0, 0),
        ("prefill", None, None, None),
    ],
)
def test_data_parallel_rank(
    mode: DisaggregationMode, dp: int | None, prefill_dp: int | None, sent: int | None
) -> None:
    req = make()
    if dp is not None:
        req.routing.dp_rank = dp
    if prefill_dp is not None:
        req.routing.prefill_dp_rank = prefill_dp
    if mode == "decode":
        req.prefill_result.disaggregated_params.update({"k": "v"})
    native = convert(req, mode)
    if sent is None:
        assert not native.HasField("data_parallel_rank")
    else:
        assert native.HasField("data_parallel_rank")
        assert native.data_parallel_rank == sent


@pytest.mark.parametrize(
    ("mode", "field", "rank", "size", "ok"),
    [
        ("agg", "dp_rank", 1, 2, True),
        ("agg", "dp_rank", 2, 2, False),
        ("agg", "dp_rank", 7, 1, False),
        ("agg", "dp_rank", 7, 0, True),  # size not known: the engine decides
        ("decode", "dp_rank", 4, 4, False),
        ("prefill", "prefill_dp_rank", 3, 3, False),
        ("prefill", "prefill_dp_rank", 2, 3, True),
        ("agg", "prefill_dp_rank", 9, 2, True),  # not sent outside prefill: not checked
    ],
)
def test_data_parallel_rank_beyond_the_engines_size_is_refused_by_name(
    mode: DisaggregationMode, field: str, rank: int, size: int, ok: bool
) -> None:
    req = make()
    setattr(req.routing, field, rank)
    if mode == "decode":
        req.prefill_result.disaggregated_params.update({"k": "v"})

    def run() -> vllm_engine_pb2.GenerateRequest:
        return to_generate_request(req, "p", mode=mode, supports_vision=False, data_parallel_size=size)

    if ok:
        run()
    else:
        with pytest.raises(SidecarError) as info:
            run()
        assert info.value.reason is FailureReason.INVALID_ARGUMENT
        assert f"routing.{field}" in info.value.message
        assert str(size) in info.value.message


# --------------------------------------------------------------------- disaggregation


def kv_json(native: vllm_engine_pb2.GenerateRequest) -> Any:
    assert native.HasField("kv_transfer_params_json")
    text = native.kv_transfer_params_json
    assert ", " not in text
    assert ": " not in text, "compact JSON"
    return json.loads(text)


def test_agg_forwards_extra_args_kv_transfer_params() -> None:
    req = make(lambda r: r.extra_args.update({"kv_transfer_params": {"a": 1, "b": [1, "x"]}}))
    assert kv_json(convert(req)) == {"a": 1, "b": [1, "x"]}


def test_prefill_adds_do_remote_decode_and_one_token() -> None:
    req = make()
    req.stop_conditions.max_tokens = 100
    req.stop_conditions.min_tokens = 5
    native = convert(req, "prefill")
    assert kv_json(native) == {"do_remote_decode": True}
    assert native.sampling_params.max_tokens == 1
    assert native.sampling_params.min_tokens == 1


def test_prefill_merges_given_kv_transfer_params() -> None:
    req = make(lambda r: r.extra_args.update({"kv_transfer_params": {"x": "y", "do_remote_decode": False}}))
    assert kv_json(convert(req, "prefill")) == {"x": "y", "do_remote_decode": True}


@pytest.mark.parametrize("port", [5600, 5600.0, "5600"])
def test_decode_forwards_the_handoff_with_a_string_port(port: Any) -> None:
    handoff = {"remote_host": "10.0.0.1", "remote_port": port, "remote_block_ids": [1, 2], "nested": {"k": 1}}
    req = make(lambda r: r.prefill_result.disaggregated_params.update(handoff))
    got = kv_json(convert(req, "decode"))
    assert got == {**handoff, "remote_port": "5600"}


def test_decode_handoff_without_a_port_is_untouched() -> None:
    req = make(lambda r: r.prefill_result.disaggregated_params.update({"engine_id": "e", "n": 2}))
    assert kv_json(convert(req, "decode")) == {"engine_id": "e", "n": 2}


def test_decode_without_a_handoff_refused() -> None:
    refused(make(), "prefill_result.disaggregated_params", mode="decode")
    refused(make(lambda r: r.prefill_result.SetInParent()), "prefill_result.disaggregated_params", "decode")


def test_decode_refuses_a_fractional_port() -> None:
    req = make(lambda r: r.prefill_result.disaggregated_params.update({"remote_port": 56.5}))
    refused(req, "prefill_result.disaggregated_params.remote_port", mode="decode")


def test_decode_refuses_extra_args_kv_transfer_params() -> None:
    def both(r: Req) -> None:
        r.prefill_result.disaggregated_params.update({"k": 1})
        r.extra_args.update({"kv_transfer_params": {"k": 2}})

    refused(make(both), "extra_args.kv_transfer_params", mode="decode")


def test_informational_fields_are_accepted() -> None:
    req = make(model="m", annotations=["a", "k:v"], eos_token_ids=[2])
    assert convert(req).request_id == "priv-1"


@given(st.integers(-(2**31), 2**32 - 1))
def test_every_32_bit_seed_maps_to_its_own_bits(seed: int) -> None:
    wire = wire_seed(seed)
    assert -(2**31) <= wire <= 2**31 - 1
    assert wire % 2**32 == seed % 2**32, "the same low 32 bits: deterministic, and one seed per bit pattern"
