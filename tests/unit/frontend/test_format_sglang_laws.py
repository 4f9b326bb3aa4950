"""Laws of the SGLang format, for random requests and random output sequences:

* Fold: the unary reply equals the stream folded (the last cumulative event; the incremental
  events concatenated), field by field.
* Batch: a batch of N prompts answers as N single requests, in order.
* Round trip: what a client sets reaches the sub-request unchanged; an explicit null stays
  distinct from an absent key where SGLang distinguishes them.
* Refusals: a field the frontend cannot carry gets a 400 naming it, and no sub-request.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import FailureReason
from sidecar_frontend.formats.base import GenerateCall, HttpReply, WorkerFailure
from sidecar_frontend.formats.sglang import ABORT, FORMAT
from tests.unit.frontend.test_format_sglang_support import (
    STARTED_AT,
    WALL_TIME,
    accepted,
    body,
    context,
    drive,
    out,
    parse,
    sse_events,
)

LAW_SETTINGS = settings(max_examples=150, deadline=None)
TOKENS = st.integers(min_value=0, max_value=50_000)
PROMPTS = st.lists(TOKENS, min_size=1, max_size=6)
LOGPROBS = st.floats(min_value=-20.0, max_value=0.0, allow_nan=False)

TERMINALS = [sidecar_pb2.LENGTH, sidecar_pb2.STOP, sidecar_pb2.EOS, sidecar_pb2.CANCELLED]
# Failures a stream renders as an item's final chunk (INVALID_ARGUMENT is an error event).
FOLDABLE_FAILURES = ["CANCELLED"]


@st.composite
def requests(draw: st.DrawFn) -> dict[str, Any]:
    prompt = draw(PROMPTS)
    fields: dict[str, Any] = {"input_ids": prompt, "rid": "r"}
    if draw(st.booleans()):
        fields["return_logprob"] = True
        fields["top_logprobs_num"] = draw(st.integers(0, 3))
        fields["logprob_start_len"] = draw(st.integers(-1, len(prompt)))
    if draw(st.booleans()):
        fields["return_prompt_token_ids"] = True
    params = draw(
        st.fixed_dictionaries(
            {},
            optional={
                "max_new_tokens": st.one_of(st.none(), st.integers(0, 64)),
                "stream_interval": st.integers(1, 4),
            },
        )
    )
    fields["sampling_params"] = params
    return fields


@st.composite
def output_runs(draw: st.DrawFn, fields: dict[str, Any]) -> list[sidecar_pb2.LLMEngineOutput | WorkerFailure]:
    """Deltas, then a terminal output (or a foldable failure)."""
    logprob = fields.get("return_logprob", False)
    top_n = fields.get("top_logprobs_num", 0)
    deltas = draw(st.lists(st.lists(TOKENS, max_size=3), max_size=5))
    steps: list[sidecar_pb2.LLMEngineOutput | WorkerFailure] = []

    def chunk(tokens: list[int], finish: int = sidecar_pb2.UNSPECIFIED) -> sidecar_pb2.LLMEngineOutput:
        values = [draw(LOGPROBS) for _ in tokens] if logprob else None
        tops = (
            [
                [(t, v), *[(draw(TOKENS), draw(LOGPROBS)) for _ in range(top_n)]]
                for t, v in zip(tokens, values or [], strict=True)
            ]
            if logprob and top_n
            else None
        )
        return out(tokens, finish, logprobs=values, tops=tops)

    for tokens in deltas:
        steps.append(chunk(tokens))
    if draw(st.booleans()):
        steps.append(WorkerFailure(FailureReason(draw(st.sampled_from(FOLDABLE_FAILURES))), "stopped"))
        return steps
    final = chunk(draw(st.lists(TOKENS, max_size=2)), draw(st.sampled_from(TERMINALS)))
    prompt = fields["input_ids"]
    final.completion_usage.prompt_tokens = len(prompt)
    final.completion_usage.cached_tokens = draw(st.integers(0, len(prompt)))
    if fields.get("logprob_start_len", -1) >= 0:
        rows: list[Any] = [None]
        for token in prompt[1:]:
            rows.append(
                [
                    {"token_id": token, "logprob": draw(LOGPROBS)},
                    {"token_id": draw(TOKENS), "logprob": draw(LOGPROBS)},
                ]
            )
        final.engine_data.update({"prompt_logprobs": rows})
    steps.append(final)
    return steps


def run(
    fields: dict[str, Any], steps: list[Any], *, stream: bool, incremental: bool = False
) -> tuple[list[Any], Any]:
    call = accepted({**fields, "stream": stream}, incremental=incremental)
    timed = [(0, step, STARTED_AT + 0.25 * (k + 1)) for k, step in enumerate(steps)]
    written, reply = drive(call, timed)
    if stream:
        return sse_events(written), None
    assert reply is not None
    assert reply.status == 200
    return [], body(reply)


def without(meta: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in meta.items() if k not in keys}


@st.composite
def fold_cases(draw: st.DrawFn) -> tuple[dict[str, Any], list[Any]]:
    fields = draw(requests())
    return fields, draw(output_runs(fields))


@LAW_SETTINGS
@given(fold_cases())
def test_fold_cumulative_last_event_is_the_unary_reply(case: tuple[dict[str, Any], list[Any]]) -> None:
    fields, steps = case
    _, unary = run(fields, steps, stream=False)
    events, _ = run(fields, steps, stream=True)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    last = chunks[-1]
    assert last["output_ids"] == unary["output_ids"]
    assert without(last["meta_info"], "response_sent_to_client_ts") == without(
        unary["meta_info"], "response_sent_to_client_ts"
    )
    assert without(last, "meta_info") == without(unary, "meta_info")
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert "response_sent_to_client_ts" in chunks[0]["meta_info"]


OUTPUT_LISTS = ("output_token_logprobs", "output_top_logprobs")


@LAW_SETTINGS
@given(fold_cases())
def test_fold_incremental_events_concatenate_to_the_unary_reply(
    case: tuple[dict[str, Any], list[Any]],
) -> None:
    fields, steps = case
    _, unary = run(fields, steps, stream=False)
    events, _ = run(fields, steps, stream=True, incremental=True)
    chunks = events[:-1]
    assert [token for c in chunks for token in c["output_ids"]] == unary["output_ids"]
    for key in OUTPUT_LISTS:
        if key in unary["meta_info"]:
            assert [row for c in chunks for row in c["meta_info"][key]] == unary["meta_info"][key]
    last = chunks[-1]["meta_info"]
    assert without(last, *OUTPUT_LISTS, "response_sent_to_client_ts") == without(
        unary["meta_info"], *OUTPUT_LISTS, "response_sent_to_client_ts"
    )


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[dict[str, Any]], list[list[Any]], list[int]]:
    singles = draw(st.lists(requests(), min_size=1, max_size=4))
    runs = [draw(output_runs(fields)) for fields in singles]
    # An interleaving of the items' steps, each item's own order kept.
    order = draw(st.permutations([i for i, run_ in enumerate(runs) for _ in run_]))
    return singles, runs, order


@LAW_SETTINGS
@given(batches())
def test_batch_of_n_is_n_single_requests_in_order(
    case: tuple[list[dict[str, Any]], list[list[Any]], list[int]],
) -> None:
    singles, runs, order = case
    shared = {"return_prompt_token_ids": True}
    batch = {
        "input_ids": [s["input_ids"] for s in singles],
        "rid": [f"item-{i}" for i in range(len(singles))],
        "sampling_params": [s["sampling_params"] for s in singles],
        "return_logprob": [s.get("return_logprob", False) for s in singles],
        "top_logprobs_num": [s.get("top_logprobs_num", 0) for s in singles],
        "logprob_start_len": [s.get("logprob_start_len", -1) for s in singles],
        **shared,
    }
    call = accepted(batch)
    cursor = [0] * len(runs)
    timed = []
    for k, index in enumerate(order):
        timed.append((index, runs[index][cursor[index]], STARTED_AT + 0.25 * (k + 1)))
        cursor[index] += 1
    _, reply = drive(call, timed)
    assert reply is not None
    items = body(reply)
    assert isinstance(items, list)
    for i, (fields, item) in enumerate(zip(singles, items, strict=True)):
        single_call = accepted({**fields, **shared, "rid": f"item-{i}"})
        assert call.requests[i] == single_call.requests[0]
        own = [(0, step, now) for index, step, now in timed if index == i]
        _, single_reply = drive(single_call, own)
        assert single_reply is not None
        assert item == body(single_reply)


def float32(value: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", value))[0])


SAMPLING_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "max_new_tokens": st.one_of(st.none(), st.integers(0, 4000)),
    "temperature": st.one_of(st.none(), st.floats(1e-3, 5.0)),
    "top_p": st.one_of(st.none(), st.floats(1e-3, 1.0)),
    "top_k": st.one_of(st.none(), st.integers(1, 2**31 - 1), st.just(-1)),
    "min_p": st.one_of(st.none(), st.floats(0.0, 1.0)),
    "frequency_penalty": st.one_of(st.none(), st.floats(-2.0, 2.0)),
    "presence_penalty": st.one_of(st.none(), st.floats(-2.0, 2.0)),
    "repetition_penalty": st.one_of(st.none(), st.floats(1e-3, 2.0)),
    "sampling_seed": st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
    "stop_token_ids": st.one_of(st.none(), st.lists(TOKENS, max_size=4)),
    "ignore_eos": st.one_of(st.none(), st.booleans()),
    "regex": st.one_of(st.none(), st.text(min_size=1, max_size=8)),
}
FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)


@LAW_SETTINGS
@given(
    prompt=PROMPTS,
    params=st.fixed_dictionaries({}, optional=SAMPLING_VALUES),
    rid=st.text(min_size=1, max_size=12),
    priority=st.one_of(st.none(), st.integers(-(2**31), 2**31 - 1)),
    lora=st.one_of(st.none(), st.text(min_size=1, max_size=8)),
)
def test_round_trip_every_set_field_reaches_the_sub_request_unchanged(
    prompt: list[int], params: dict[str, Any], rid: str, priority: int | None, lora: str | None
) -> None:
    call = accepted(
        {"input_ids": prompt, "rid": rid, "sampling_params": params, "priority": priority, "lora_path": lora}
    )
    (sub,) = call.requests
    assert sub.request_id == rid
    assert list(sub.token_ids) == prompt
    sampling, stop = sub.sampling_options, sub.stop_conditions
    for name in FLOAT_FIELDS:
        value = params.get(name)
        assert sampling.HasField(name) == (value is not None)  # type: ignore[arg-type]
        if value is not None:
            assert getattr(sampling, name) == float32(value)
    top_k = params.get("top_k")
    assert sampling.HasField("top_k") == (top_k is not None)
    if top_k is not None:
        assert sampling.top_k == top_k
    seed = params.get("sampling_seed")
    assert sampling.HasField("seed") == (seed is not None)
    if seed is not None:
        assert sampling.seed == seed
    regex = params.get("regex")
    assert sampling.guided_decoding.regex == (regex or "")
    ignore_eos = params.get("ignore_eos")
    assert stop.HasField("ignore_eos") == (ignore_eos is not None)
    expected_stops = [] if ignore_eos else list(dict.fromkeys(params.get("stop_token_ids") or []))
    assert list(stop.stop_token_ids) == expected_stops
    # Absent = SGLang's default 128, null = unlimited; both within the context.
    cap = 4096 - 1 - len(prompt) - 1
    raw = params.get("max_new_tokens", "absent")
    expected_max = min(128, cap) if raw == "absent" else cap if raw is None else min(raw, cap)
    assert stop.max_tokens == expected_max
    assert sub.routing.HasField("priority") == (priority is not None)
    if priority is not None:
        assert sub.routing.priority == priority
    assert sub.routing.HasField("lora_name") == (lora is not None)
    if lora is not None:
        assert sub.routing.lora_name == lora
    # The response echoes the rid the client chose.
    _, reply = drive(call, [(0, out([5], sidecar_pb2.LENGTH), STARTED_AT + 1)])
    assert reply is not None
    assert body(reply)["meta_info"]["id"] == rid
    assert body(reply)["meta_info"]["response_sent_to_client_ts"] == WALL_TIME + 1


UNCARRIED: dict[str, st.SearchStrategy[Any]] = {
    "image_data": st.text(min_size=1),
    "video_data": st.text(min_size=1),
    "audio_data": st.text(min_size=1),
    "bootstrap_host": st.text(min_size=1),
    "bootstrap_port": st.integers(1, 65535),
    "bootstrap_room": st.integers(1, 2**63 - 1),
    "bootstrap_pair_key": st.text(min_size=1),
    "decode_tp_size": st.integers(1, 64),
    "routed_dp_rank": st.integers(1, 64),
    "disagg_prefill_dp_rank": st.integers(1, 64),
    "routing_key": st.text(min_size=1),
    "session_params": st.dictionaries(st.text(min_size=1), st.integers(), min_size=1),
    "session_id": st.text(min_size=1),
    "extra_key": st.text(min_size=1),
    "cache_salt": st.text(min_size=1),
    "require_reasoning": st.just(True),
    "input_embeds": st.just([[0.5, 0.25]]),
}
UNCARRIED_SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "choice": st.lists(st.text(min_size=1), min_size=1),
    "beam_width": st.integers(2, 16),
    "watermark": st.just({"enabled": True}),
}


@LAW_SETTINGS
@given(
    base=requests(),
    field=st.sampled_from(sorted(UNCARRIED) + sorted(UNCARRIED_SAMPLING)),
    data=st.data(),
    stream=st.booleans(),
)
def test_refusals_name_the_field_and_reach_no_worker(
    base: dict[str, Any], field: str, data: st.DataObject, stream: bool
) -> None:
    fields = {**base, "stream": stream}
    if field in UNCARRIED:
        value = data.draw(UNCARRIED[field])
        if field == "input_embeds":
            del fields["input_ids"]
        fields[field] = value
        named = field
    else:
        fields["sampling_params"] = {**fields["sampling_params"], field: data.draw(UNCARRIED_SAMPLING[field])}
        named = f"sampling_params.{field}"
    reply = parse(fields)
    assert not isinstance(reply, GenerateCall)
    assert isinstance(reply, HttpReply)
    if stream:
        assert reply.status == 200
        message = sse_events(reply.body)[0]["error"]["message"]
    else:
        assert reply.status == 400
        message = json.loads(reply.body)["error"]["message"]
    assert message.startswith(f"{named} is not supported by this server")


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
TOP_KEYS = [
    "input_ids", "rid", "text", "stream", "sampling_params", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "lora_path", "priority", "return_prompt_token_ids", "input_embeds", "image_data",
    "bootstrap_room", "session_params", "custom_logit_processor", "return_hidden_states",
    "max_thinking_tokens",
]  # fmt: skip
SAMPLING_KEYS = [
    "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "n", "json_schema",
    "regex", "ebnf", "logit_bias", "sampling_seed", "custom_params", "stream_interval", "beam_width",
]  # fmt: skip
ROBUST_SETTINGS = settings(max_examples=300, deadline=None)


def judged(raw: bytes, ctx: Any = None) -> None:
    """Any body gets an answer, never an exception; what is accepted can go on the wire."""
    result = parse(raw, ctx)
    if isinstance(result, HttpReply):
        assert result.status in (200, 400)
        if result.status == 200:
            assert sse_events(result.body)[-1] == "[DONE]"
        else:
            json.loads(result.body)
        return
    assert result.requests
    for request in result.requests:
        request.SerializeToString()
    encoder_steps = [(i, out([1], sidecar_pb2.LENGTH), STARTED_AT + 1) for i in range(len(result.requests))]
    drive(result, encoder_steps)


@ROBUST_SETTINGS
@given(st.one_of(JSON_VALUES, st.binary(max_size=40)))
def test_any_body_is_answered(value: Any) -> None:
    judged(value if isinstance(value, bytes) else json.dumps(value).encode())


@ROBUST_SETTINGS
@given(
    base=requests(),
    top=st.dictionaries(st.sampled_from(TOP_KEYS), JSON_VALUES, max_size=3),
    sampling=st.dictionaries(st.sampled_from(SAMPLING_KEYS), JSON_VALUES, max_size=3),
    known_context=st.booleans(),
)
def test_any_mutation_of_a_valid_request_is_answered(
    base: dict[str, Any], top: dict[str, Any], sampling: dict[str, Any], known_context: bool
) -> None:
    fields = {**base, **top}
    if isinstance(fields.get("sampling_params"), dict):
        fields["sampling_params"] = {**fields["sampling_params"], **sampling}
    ctx = context() if known_context else context(max_context_length=0, vocab_size=0)
    judged(json.dumps(fields).encode(), ctx)


@ROBUST_SETTINGS
@given(st.one_of(JSON_VALUES, st.binary(max_size=20)))
def test_any_abort_body_is_answered(value: Any) -> None:
    raw = value if isinstance(value, bytes) else json.dumps(value).encode()
    result = FORMAT.parse_abort(ABORT, raw, {})
    if isinstance(result, HttpReply):
        assert result.status == 400
        json.loads(result.body)
    else:
        assert all(isinstance(rid, str) and rid for rid in result.request_ids)
