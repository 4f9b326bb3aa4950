"""vLLM engine stream -> LLMEngineOutput deltas: ResponseState, table by table (docs/vllm.md)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

import pytest
from google.protobuf import json_format
from smg_grpc_proto.generated import vllm_engine_pb2

from sidecar_common.api import sidecar_pb2
from sidecar_common.disaggregation import DisaggregationMode
from sidecar_common.errors import FailureReason, SidecarError
from sidecar_common.logprob_floor import LOGPROB_FLOOR
from sidecar_vllm.convert import ResponseState
from tests.vllm_fixtures import chunk, complete, output_logprobs, servicer_stream

Out = sidecar_pb2.LLMEngineOutput


def request(**opts: Any) -> sidecar_pb2.PreprocessedRequest:
    req = sidecar_pb2.PreprocessedRequest(request_id="r", token_ids=[10, 11, 12])
    if "n" in opts:
        req.sampling_options.n = opts["n"]
    if "stops" in opts:
        req.stop_conditions.stop_token_ids.extend(opts["stops"])
    if "logprobs" in opts:
        req.output_options.logprobs = opts["logprobs"]
    if "prompt_logprobs" in opts:
        req.output_options.prompt_logprobs = opts["prompt_logprobs"]
    return req


def run(
    msgs: Iterable[vllm_engine_pb2.GenerateResponse],
    mode: DisaggregationMode = "agg",
    **opts: Any,
) -> tuple[list[Out], ResponseState]:
    state = ResponseState(request(**opts), mode)
    outs: list[Out] = []
    for m in msgs:
        outs.extend(state.feed(m))
    return outs, state


def tokens(outs: list[Out], index: int = 0) -> list[int]:
    return [t for o in outs if o.index == index for t in o.token_ids]


def fails(msgs: Iterable[vllm_engine_pb2.GenerateResponse], reason: FailureReason, **opts: Any) -> str:
    with pytest.raises(SidecarError) as info:
        run(msgs, **opts)
    assert info.value.reason is reason
    return info.value.message


# ------------------------------------------------------------------------ token deltas


def test_each_chunk_is_one_delta_and_the_restating_complete_adds_nothing() -> None:
    outs, state = run(servicer_stream([[1, 2], [3], [4, 5]]))
    assert [list(o.token_ids) for o in outs] == [[1, 2], [3], [4, 5], []]
    assert [o.finish_reason for o in outs] == [0, 0, 0, sidecar_pb2.LENGTH]
    assert state.finished


def test_complete_restating_a_repeated_token_is_not_a_new_token() -> None:
    # The final delta equals an earlier one: still a restatement of the last chunk.
    outs, _ = run(servicer_stream([[7], [7]]))
    assert tokens(outs) == [7, 7]


def test_empty_chunks_emit_nothing() -> None:
    outs, state = run([chunk([]), chunk([1]), chunk([]), chunk([]), complete([], "length")])
    assert [list(o.token_ids) for o in outs] == [[1], []]
    assert state.finished


def test_complete_carrying_every_token_without_chunks_forwards_them_once() -> None:
    outs, _ = run([complete([1, 2, 3], "length")])
    assert [list(o.token_ids) for o in outs] == [[1, 2, 3]]
    assert outs[0].completion_usage.completion_tokens == 3


def test_cumulative_complete_forwards_only_the_unstreamed_tail() -> None:
    outs, _ = run([chunk([1, 2]), chunk([3]), chunk([]), complete([1, 2, 3, 4], "length")])
    assert tokens(outs) == [1, 2, 3, 4]
    assert list(outs[-1].token_ids) == [4]


def test_complete_contradicting_the_stream_is_a_protocol_error() -> None:
    msg = fails([chunk([1, 2]), chunk([3]), complete([9], "length")], FailureReason.PROTOCOL_ERROR)
    assert msg.startswith("invalid vllm response:")


def test_nothing_after_a_terminal_is_forwarded() -> None:
    msgs = [*servicer_stream([[1]]), chunk([2]), complete([1, 2], "stop"), chunk([3])]
    outs, state = run(msgs)
    assert tokens(outs) == [1]
    assert sum(o.finish_reason != 0 for o in outs) == 1
    assert state.finished


def test_unfinished_until_the_complete() -> None:
    state = ResponseState(request(), "agg")
    state.feed(chunk([1]))
    assert not state.finished


# ----------------------------------------------------------------------- finish reasons


@pytest.mark.parametrize(
    ("reason", "finish"),
    [("length", sidecar_pb2.LENGTH), ("stop", sidecar_pb2.STOP), ("abort", sidecar_pb2.CANCELLED)],
)
def test_finish_reasons(reason: str, finish: int) -> None:
    outs, state = run(servicer_stream([[1]], reason))
    assert outs[-1].finish_reason == finish
    assert state.finished


def test_error_finish_is_an_unknown_engine_error() -> None:
    msg = fails(servicer_stream([[1]], "error"), FailureReason.UNKNOWN)
    assert "engine reported an error" in msg


@pytest.mark.parametrize("reason", ["", "eos", "STOP", "timeout"])
def test_unknown_finish_reason_is_a_protocol_error(reason: str) -> None:
    msg = fails(servicer_stream([[1]], reason), FailureReason.PROTOCOL_ERROR)
    assert "unknown finish reason" in msg


# -------------------------------------------------------------------------- stop reason


def test_stop_string_is_reported() -> None:
    outs, _ = run([chunk([1]), complete([1], "stop", matched_str="END")])
    assert outs[-1].WhichOneof("stop_reason") == "stop_string"
    assert outs[-1].stop_string == "END"


def test_user_stop_token_is_reported() -> None:
    outs, _ = run([chunk([1, 9]), complete([1, 9], "stop", matched_token=9)], stops=[9])
    assert outs[-1].WhichOneof("stop_reason") == "stop_token_id"
    assert outs[-1].stop_token_id == 9


def test_eos_or_hidden_stop_token_is_not_reported() -> None:
    outs, _ = run([chunk([1, 2]), complete([1, 2], "stop", matched_token=2)], stops=[9])
    assert outs[-1].finish_reason == sidecar_pb2.STOP
    assert outs[-1].WhichOneof("stop_reason") is None


@pytest.mark.parametrize("stops", [[2], [9, 2]])
def test_eos_the_caller_listed_among_its_stops_is_reported(stops: list[int]) -> None:
    # vLLM checks its EOS before the stop ids and reports no match for it (the testkit does
    # the same): the last token says which stop it was.
    outs, _ = run([chunk([1, 2]), complete([1, 2], "stop")], stops=stops)
    assert outs[-1].finish_reason == sidecar_pb2.STOP
    assert outs[-1].WhichOneof("stop_reason") == "stop_token_id"
    assert outs[-1].stop_token_id == 2


def test_eos_the_caller_did_not_list_is_not_reported() -> None:
    outs, _ = run([chunk([1, 2]), complete([1, 2], "stop")], stops=[9])
    assert outs[-1].WhichOneof("stop_reason") is None


def test_a_hidden_stop_id_other_than_the_primary_eos_is_not_reported() -> None:
    # The frontend hides the model's extra EOS ids (e.g. <|eot_id|> beside </s>) in
    # stop_token_ids_hidden: matching one is an EOS-like stop, never the user's stop token.
    req = request(stops=[9])
    req.eos_token_ids.append(2)
    req.stop_conditions.stop_token_ids_hidden.extend([2, 7])
    for matched, reported in ((7, None), (2, None), (9, 9)):
        state = ResponseState(req, "agg")
        outs = [
            o
            for m in (chunk([1, matched]), complete([1, matched], "stop", matched_token=matched))
            for o in state.feed(m)
        ]
        assert outs[-1].finish_reason == sidecar_pb2.STOP
        if reported is None:
            assert outs[-1].WhichOneof("stop_reason") is None, matched
        else:
            assert outs[-1].stop_token_id == reported


def test_stop_without_a_match_has_no_stop_reason() -> None:
    outs, _ = run(servicer_stream([[1]], "stop"))
    assert outs[-1].WhichOneof("stop_reason") is None


def test_length_never_carries_a_stop_reason() -> None:
    outs, _ = run([chunk([9]), complete([9], "length", matched_token=9)], stops=[9])
    assert outs[-1].WhichOneof("stop_reason") is None


# ---------------------------------------------------------------------------------- usage


def test_usage_counts_forwarded_tokens_not_the_engines_per_message_counts() -> None:
    msgs = [chunk([1, 2], cached=2), chunk([3], cached=2), complete([3], "length", prompt=3, cached=2)]
    outs, _ = run(msgs)
    usage = outs[-1].completion_usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (3, 3, 6)
    assert usage.HasField("cached_tokens")
    assert usage.cached_tokens == 2
    assert all(not o.HasField("completion_usage") for o in outs[:-1])


def test_usage_prompt_count_is_the_engines() -> None:
    outs, _ = run([chunk([1], prompt=40), complete([1], prompt=40)])
    assert outs[-1].completion_usage.prompt_tokens == 40


def test_usage_with_no_tokens() -> None:
    outs, _ = run(servicer_stream([], "abort"))
    usage = outs[-1].completion_usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (3, 0, 3)


# ------------------------------------------------------------------------------- n > 1


def test_interleaved_choices_each_get_their_tokens_and_one_terminal() -> None:
    msgs = [
        chunk([1], 0),
        chunk([5], 1),
        chunk([2], 0),
        complete([2], "length", 0),
        chunk([6], 1),
        complete([6], "stop", 1),
    ]
    outs, state = run(msgs, n=2)
    assert tokens(outs, 0) == [1, 2]
    assert tokens(outs, 1) == [5, 6]
    terminals = [(o.index, o.finish_reason) for o in outs if o.finish_reason]
    assert terminals == [(0, sidecar_pb2.LENGTH), (1, sidecar_pb2.STOP)]
    assert state.finished


def test_one_choice_done_is_not_the_end() -> None:
    _, state = run(servicer_stream([[1]], index=0), n=2)
    assert not state.finished


@pytest.mark.parametrize("msg", [chunk([1], 2), complete([1], "stop", 2)])
def test_choice_index_beyond_n_is_a_protocol_error(msg: vllm_engine_pb2.GenerateResponse) -> None:
    fails([msg], FailureReason.PROTOCOL_ERROR, n=2)


# ------------------------------------------------------------------------------ logprobs


def test_logprobs_are_aligned_and_top_lists_lead_with_the_sampled_token() -> None:
    lp = output_logprobs([4, 5], [-0.5, -1.5], [[(4, -0.5), (8, -2.0)], [(9, -0.25), (5, -1.5)]])
    outs, _ = run([chunk([4, 5], logprobs=lp), complete([4, 5], logprobs=lp)], logprobs=2)
    first = outs[0]
    assert list(first.log_probs) == [-0.5, -1.5]
    assert [[(e.token_id, e.logprob) for e in t.entries] for t in first.top_logprobs] == [
        [(4, -0.5), (8, -2.0)],
        [(5, -1.5), (9, -0.25)],
    ]
    ranks = [[e.rank if e.HasField("rank") else None for e in t.entries] for t in first.top_logprobs]
    # 4 leads 8: ranks 1 and 2. 5 trails 9, the only alternative: 9 is rank 1, and 5 is the
    # 2nd or beyond the top 2 (the wire keeps k entries): unknown.
    assert ranks == [[1, 2], [None, 1]]
    assert list(outs[-1].log_probs) == []


def test_logprobs_zero_gives_the_sampled_token_alone() -> None:
    lp = output_logprobs([4], [-0.5], [[(4, -0.5), (8, -2.0)]])
    outs, _ = run([chunk([4], logprobs=lp), complete([4], logprobs=lp)], logprobs=0)
    assert [[(e.token_id, e.logprob) for e in t.entries] for t in outs[0].top_logprobs] == [[(4, -0.5)]]


def test_logprobs_not_asked_are_not_forwarded() -> None:
    lp = output_logprobs([4], [-0.5])
    outs, _ = run([chunk([4], logprobs=lp), complete([4], logprobs=lp)])
    assert not outs[0].log_probs
    assert not outs[0].top_logprobs


@pytest.mark.parametrize(
    ("value", "sent"),
    [
        (float("nan"), LOGPROB_FLOOR),
        (float("-inf"), LOGPROB_FLOOR),
        (float("inf"), LOGPROB_FLOOR),
        (-1e6, LOGPROB_FLOOR),
        (-9999.0, -9999.0),
        (-3.0, -3.0),
    ],
)
def test_logprob_values_are_clamped(value: float, sent: float) -> None:
    lp = output_logprobs([4], [value], [[(7, value)]])
    outs, _ = run([chunk([4], logprobs=lp), complete([4])], logprobs=1)
    assert outs[0].log_probs[0] == sent
    assert [e.logprob for e in outs[0].top_logprobs[0].entries] == [sent, sent]
    assert not math.isnan(outs[0].log_probs[0])


@pytest.mark.parametrize(
    "lp",
    [
        None,
        output_logprobs([4, 5], [-0.5]),
        output_logprobs([4], [-0.5, -0.1]),
        output_logprobs([4, 6], [-0.5, -0.1]),
        output_logprobs([4, 5], [-0.5, -0.1], [[(1, -1.0)]]),
        vllm_engine_pb2.OutputLogProbs(
            token_ids=[4, 5],
            token_logprobs=[-0.5, -0.1],
            top_logprobs=[vllm_engine_pb2.TopLogProbs(token_ids=[1, 2], values=[-1.0])] * 2,
        ),
    ],
)
def test_misaligned_logprobs_are_a_protocol_error(lp: vllm_engine_pb2.OutputLogProbs | None) -> None:
    fails([chunk([4, 5], logprobs=lp)], FailureReason.PROTOCOL_ERROR, logprobs=1)


def test_logprobs_of_a_cumulative_complete_cover_only_the_new_tail() -> None:
    full = output_logprobs([4, 5], [-0.5, -1.5])
    outs, _ = run(
        [chunk([4], logprobs=output_logprobs([4], [-0.5])), complete([4, 5], logprobs=full)], logprobs=0
    )
    assert list(outs[-1].token_ids) == [5]
    assert list(outs[-1].log_probs) == [-1.5]


def prompt_lp() -> vllm_engine_pb2.InputLogProbs:
    lp = vllm_engine_pb2.InputLogProbs(token_ids=[10, 11, 12])
    lp.token_logprobs.add()
    lp.token_logprobs.add(value=-1.25)
    lp.token_logprobs.add(value=float("nan"))
    lp.top_logprobs.add()
    lp.top_logprobs.add(token_ids=[11, 3], values=[-1.25, -0.5])
    lp.top_logprobs.add(token_ids=[4], values=[-0.75])
    return lp


def test_prompt_logprobs_go_on_the_terminal_engine_data() -> None:
    msgs = [chunk([1], input_logprobs=prompt_lp()), chunk([2]), complete([2])]
    outs, _ = run(msgs, prompt_logprobs=1)
    assert all(not o.HasField("engine_data") for o in outs[:-1])
    data = json_format.MessageToDict(outs[-1].engine_data)
    assert data["prompt_logprobs"] == [
        None,
        {"11": {"logprob": -1.25}, "3": {"logprob": -0.5, "rank": 1}},
        {"12": {"logprob": LOGPROB_FLOOR}, "4": {"logprob": -0.75, "rank": 1}},
    ]


def test_prompt_logprobs_go_on_the_terminal_typed_the_prompt_token_first() -> None:
    msgs = [chunk([1], input_logprobs=prompt_lp()), chunk([2]), complete([2])]
    outs, _ = run(msgs, prompt_logprobs=1)
    assert all(not o.prompt_logprobs for o in outs[:-1])
    positions = [
        [(e.token_id, e.logprob, e.rank if e.HasField("rank") else None) for e in p.entries]
        for p in outs[-1].prompt_logprobs
    ]
    # The prompt token's rank is unknown where no alternative is less likely than it.
    assert positions == [[], [(11, -1.25, None), (3, -0.5, 1)], [(12, LOGPROB_FLOOR, None), (4, -0.75, 1)]]


def test_prompt_logprobs_on_every_choice_terminal() -> None:
    msgs = [
        chunk([1], 0, input_logprobs=prompt_lp()),
        complete([1], index=0),
        chunk([2], 1),
        complete([2], index=1),
    ]
    outs, _ = run(msgs, prompt_logprobs=0, n=2)
    assert [o.HasField("engine_data") for o in outs if o.finish_reason] == [True, True]


def _complete_with_prompt_lp(ids: list[int]) -> vllm_engine_pb2.GenerateResponse:
    done = complete(ids)
    done.complete.input_logprobs.CopyFrom(prompt_lp())
    return done


def test_prompt_logprobs_not_asked_are_not_forwarded() -> None:
    outs, _ = run([chunk([1], input_logprobs=prompt_lp()), complete([1])])
    assert not outs[-1].HasField("engine_data")
    outs, _ = run([_complete_with_prompt_lp([1])])
    assert not outs[-1].HasField("engine_data")


def test_prompt_logprobs_carried_only_by_the_complete_are_forwarded() -> None:
    # The non-streaming shape: one complete with every token and the prompt's logprobs.
    outs, _ = run([_complete_with_prompt_lp([1, 2])], prompt_logprobs=1)
    assert tokens(outs) == [1, 2]
    data = json_format.MessageToDict(outs[-1].engine_data)
    assert data["prompt_logprobs"][1] == {"11": {"logprob": -1.25}, "3": {"logprob": -0.5, "rank": 1}}


def test_misaligned_prompt_logprobs_are_a_protocol_error() -> None:
    lp = prompt_lp()
    lp.token_ids.append(13)
    fails([chunk([1], input_logprobs=lp)], FailureReason.PROTOCOL_ERROR, prompt_logprobs=1)


# ------------------------------------------------------------------------------ prefill


def test_prefill_terminal_carries_the_handoff_and_no_tokens() -> None:
    handoff = {"remote_host": "h", "remote_port": 5600, "remote_block_ids": [1, 2]}
    msgs = [chunk([42]), complete([42], "length", kv_json=json.dumps(handoff))]
    outs, state = run(msgs, "prefill")
    assert len(outs) == 1
    term = outs[0]
    assert list(term.token_ids) == []
    assert term.finish_reason == sidecar_pb2.LENGTH
    assert json_format.MessageToDict(term.disaggregated_params) == handoff
    usage = term.completion_usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (3, 0, 3)
    assert state.finished


@pytest.mark.parametrize("kv", [None, "", "nope", "[1]", "5", '{"a": NaN}'])
def test_successful_prefill_without_a_valid_handoff_is_a_protocol_error(kv: str | None) -> None:
    fails([chunk([42]), complete([42], "length", kv_json=kv)], FailureReason.PROTOCOL_ERROR, mode="prefill")


def test_aborted_prefill_is_cancelled_without_handoff_or_error() -> None:
    outs, state = run([chunk([]), complete([], "abort")], "prefill")
    assert outs[-1].finish_reason == sidecar_pb2.CANCELLED
    assert not outs[-1].HasField("disaggregated_params")
    assert state.finished


def test_decode_and_agg_ignore_a_handoff() -> None:
    outs, _ = run([chunk([1]), complete([1], kv_json='{"a":1}')])
    assert not outs[-1].HasField("disaggregated_params")


@pytest.mark.parametrize(
    "msg",
    [
        vllm_engine_pb2.GenerateResponse(
            chunk=vllm_engine_pb2.GenerateStreamChunk(token_ids=[1], completion_tokens=2)
        ),
        vllm_engine_pb2.GenerateResponse(
            complete=vllm_engine_pb2.GenerateComplete(
                output_ids=[1], completion_tokens=8, finish_reason="stop"
            )
        ),
    ],
)
def test_per_message_count_that_disagrees_with_the_ids_is_a_protocol_error(
    msg: vllm_engine_pb2.GenerateResponse,
) -> None:
    assert "completion_tokens" in fails([msg], FailureReason.PROTOCOL_ERROR)


# ------------------------------------------------------------------------------------ ranks
# vLLM's per-position dict is the own token (sampled, or the prompt's) with its rank, then the
# top k with ranks 1..k; its servicer sends the first k entries, without ranks. Rows: the
# wire's entries for k = 3 -> the ranks the sidecar gives them (own token first).
RANK_ROWS: list[tuple[str, list[tuple[int, float]], list[int | None]]] = [
    ("own token first of the top 3", [(50, -0.1), (60, -1.0), (70, -2.0)], [1, 2, 3]),
    ("own token second", [(50, -1.0), (60, -0.1), (70, -2.0)], [2, 1, 3]),
    ("own token third: the 3rd or beyond, unknown", [(50, -3.0), (60, -0.1), (70, -1.0)], [None, 1, 2]),
    (
        "a tie counts the other token first, as vLLM counts rank",
        [(50, -1.0), (60, -1.0), (70, -2.0)],
        [2, 1, 3],
    ),
]


@pytest.mark.parametrize(("wire", "ranks"), [r[1:] for r in RANK_ROWS], ids=[r[0] for r in RANK_ROWS])
def test_sampled_token_ranks_follow_from_the_wires_order(
    wire: list[tuple[int, float]], ranks: list[int | None]
) -> None:
    token, value = wire[0]
    lp = output_logprobs([token], [value], [wire])
    outs, _ = run([chunk([token], logprobs=lp), complete([token], logprobs=lp)], logprobs=3)
    (top,) = outs[0].top_logprobs
    assert [(e.token_id, e.rank if e.HasField("rank") else None) for e in top.entries] == [
        (t, r) for (t, _), r in zip(wire, ranks, strict=True)
    ]


def test_a_prompt_token_outside_the_top_k_arrives_without_the_kth_alternative() -> None:
    # vLLM's dict for a prompt token of rank 9 with k = 2: {p: rank 9, a: 1, b: 2}. The
    # servicer keeps the first 2 entries: p and a. b (rank 2) never reaches the sidecar, and
    # p's rank is unknown: the wire cannot tell it from a p of rank 2.
    lp = vllm_engine_pb2.InputLogProbs(token_ids=[10, 11])
    lp.token_logprobs.add()
    lp.token_logprobs.add(value=-7.0)
    lp.top_logprobs.add()
    lp.top_logprobs.add(token_ids=[11, 40], values=[-7.0, -0.25])
    outs, _ = run([chunk([1], input_logprobs=lp), complete([1])], prompt_logprobs=2)
    data = json_format.MessageToDict(outs[-1].engine_data)
    assert data["prompt_logprobs"] == [None, {"11": {"logprob": -7.0}, "40": {"logprob": -0.25, "rank": 1}}]
