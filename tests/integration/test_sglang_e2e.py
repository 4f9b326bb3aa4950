"""The SGLang sidecar end to end, once per transport: testkit SGLang engine <- the gRPC or HTTP
adapter <- SidecarServer <- a real gRPC client of the public API, on 127.0.0.1 in one process."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from google.protobuf import json_format
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from testkit.faults import FaultKind, FaultPlan
from testkit.generator import EOS_TRIGGER_TOKEN, SamplingSpec, detokenize, generate
from testkit.sglang_engine import SglangTestEngine
from testkit.sglang_info import SglangEngineConfig

from sidecar_common.api import sidecar_pb2, sidecar_pb2_grpc
from sidecar_common.errors import FailureReason, SidecarError
from tests.e2e_helpers import (
    PROMPT,
    collect,
    collect_until_error,
    private_ids,
    public_request,
    reason_of,
    terminal,
    tokens,
    until,
)
from tests.sglang_fixtures import Stack, Transport, adapter_for, sglang_stack

pytestmark = [pytest.mark.timeout(60), pytest.mark.slow(16)]

TRANSPORTS = pytest.mark.parametrize("transport", ["grpc", "http"])


def expected(stack: Stack, prompt: list[int] = PROMPT, **sampling: Any) -> list[int]:
    return [t.token_id for t in generate(stack.engine.model, prompt, SamplingSpec(**sampling), 0)]


async def idle(stack: Stack) -> None:
    await until(lambda: stack.engine.book.running_count == 0 and not stack.engine.live_ids(), "engine idle")


# ---------------------------------------------------------------------------- discovery


@TRANSPORTS
async def test_model_info_and_load_come_from_the_engine(transport: Transport) -> None:
    async with sglang_stack(transport, served_model_name="tiny", dp_size=2, page_size=16) as s:
        info = await s.stub.GetModelInfo(sidecar_pb2.GetModelInfoRequest(), timeout=5)
        assert (info.engine, info.served_model_name, info.disaggregation_mode) == ("sglang", "tiny", "agg")
        assert (info.max_context_length, info.kv_block_size, info.data_parallel_size) == (4096, 16, 2)
        assert info.total_kv_blocks == s.engine.config.kv_capacity_tokens // 16
        assert info.engine_version == ("0.5.23" if transport == "http" else "")
        load = await s.stub.GetLoad(sidecar_pb2.GetLoadRequest(), timeout=5)
        assert [r.dp_rank for r in load.ranks] == [0, 1]
        assert all(r.running_requests == 0 for r in load.ranks)


@TRANSPORTS
async def test_a_disagreeing_disaggregation_mode_fails_start_up(transport: Transport) -> None:
    engine = SglangTestEngine(SglangEngineConfig(disaggregation_mode="null"))
    await engine.start()
    adapter = adapter_for(engine, transport, "prefill")
    try:
        with pytest.raises(SidecarError) as info:
            await adapter.start()
        assert "prefill" in info.value.message
        assert "agg" in info.value.message
    finally:
        await adapter.close()
        await engine.stop()


@TRANSPORTS
async def test_no_engine_within_the_deadline_is_cannot_connect(transport: Transport) -> None:
    engine = SglangTestEngine(SglangEngineConfig(startup_delay_secs=30))
    await engine.start()
    adapter = adapter_for(engine, transport, deadline=0.5, connections=1)
    try:
        with pytest.raises(SidecarError) as info:
            await adapter.start()
        assert info.value.reason is FailureReason.CANNOT_CONNECT
    finally:
        await adapter.close()
        await engine.stop()


# ---------------------------------------------------------------------------- generation


@TRANSPORTS
@pytest.mark.parametrize("incremental", [False, True])
async def test_streaming_with_usage(transport: Transport, incremental: bool) -> None:
    async with sglang_stack(transport, incremental=incremental, chunk_tokens=2) as s:
        outs = await collect(s.stub.Generate(public_request(max_tokens=7), timeout=10))
        assert tokens(outs) == expected(s, max_tokens=7)
        end = terminal(outs, last=True)
        assert end.finish_reason == sidecar_pb2.LENGTH
        usage = end.completion_usage
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (4, 7, 11)
        assert usage.cached_tokens == 0
        assert len(outs) > 1, "streamed, not one block"
        await idle(s)


@TRANSPORTS
async def test_eos_stops_without_a_stop_reason(transport: Transport) -> None:
    async with sglang_stack(transport) as s:
        prompt = [EOS_TRIGGER_TOKEN, 3, 500]
        req = public_request(token_ids=prompt, stop_token_ids_hidden=[2], max_tokens=20)
        outs = await collect(s.stub.Generate(req, timeout=10))
        assert tokens(outs)[-1] == 2
        end = terminal(outs, last=True)
        assert end.finish_reason == sidecar_pb2.STOP
        assert end.WhichOneof("stop_reason") is None
        sent = s.engine.book.requests()[0]
        stop_ids = (
            list(sent.sampling_params.stop_token_ids)  # type: ignore[attr-defined]
            if transport == "grpc"
            else sent["sampling_params"]["stop_token_ids"]  # type: ignore[index]
        )
        assert stop_ids == [2]


@TRANSPORTS
async def test_user_stop_token_and_stop_string_are_reported(transport: Transport) -> None:
    async with sglang_stack(transport) as s:
        free_run = expected(s, max_tokens=12)
        stop = free_run[4]
        outs = await collect(
            s.stub.Generate(public_request(max_tokens=12, stop_token_ids=[stop]), timeout=10)
        )
        assert tokens(outs) == free_run[: free_run.index(stop) + 1]
        assert terminal(outs, last=True).stop_token_id == stop
        word = next(detokenize(t) for t in free_run[3:] if len(detokenize(t)) > 1)
        outs = await collect(s.stub.Generate(public_request(max_tokens=12, stop=[word]), timeout=10))
        end = terminal(outs, last=True)
        assert (end.finish_reason, end.stop_string) == (sidecar_pb2.STOP, word)
        assert tokens(outs) == free_run[: len(tokens(outs))]


@TRANSPORTS
@pytest.mark.parametrize("incremental", [False, True])
async def test_logprobs_and_prompt_logprobs(transport: Transport, incremental: bool) -> None:
    async with sglang_stack(transport, incremental=incremental) as s:
        req = public_request(max_tokens=5)
        req.output_options.logprobs = 2
        req.output_options.prompt_logprobs = 1
        outs = await collect(s.stub.Generate(req, timeout=10))
        assert tokens(outs) == expected(s, max_tokens=5)
        for o in outs:
            assert len(o.log_probs) == len(o.token_ids) == len(o.top_logprobs)
            for tok, lp, top in zip(o.token_ids, o.log_probs, o.top_logprobs, strict=True):
                assert top.entries[0].token_id == tok
                assert top.entries[0].logprob == pytest.approx(lp)
                assert len(top.entries) <= 3
        # SGLang sends them with its first event after prefill: so does the sidecar, once.
        carriers = [o for o in outs if o.HasField("engine_data")]
        assert carriers == [outs[0]]
        rows = json_format.MessageToDict(outs[0].engine_data)["prompt_logprobs"]
        assert len(rows) == len(PROMPT)
        assert rows[0] is None
        assert [row[0]["token_id"] for row in rows[1:]] == PROMPT[1:]


# ------------------------------------------------------------------------- disaggregation


@TRANSPORTS
async def test_prefill_then_decode_reproduces_the_bootstrap_triple(transport: Transport) -> None:
    async with (
        sglang_stack(transport, mode="prefill", bootstrap_port=8998) as p,
        sglang_stack(transport, mode="decode") as d,
    ):
        pre = await collect(p.stub.Generate(public_request("pd", max_tokens=8), timeout=10))
        end = terminal(pre, last=True)
        assert tokens(pre) == []
        assert (end.completion_usage.prompt_tokens, end.completion_usage.completion_tokens) == (4, 0)
        params = json_format.MessageToDict(end.disaggregated_params)
        assert (params["bootstrap_host"], params["bootstrap_port"]) == ("127.0.0.1", 8998)
        if transport == "http":
            assert len(pre) == 2, "the handoff comes at the response headers, then the terminal"
            assert pre[0].disaggregated_params == end.disaggregated_params
        [prefill_pid] = private_ids(p)
        triple = p.engine.bootstraps[prefill_pid]

        req = public_request("pd", max_tokens=8)
        req.prefill_result.disaggregated_params.CopyFrom(end.disaggregated_params)
        outs = await collect(d.stub.Generate(req, timeout=10))
        assert len(tokens(outs)) == 8
        [decode_pid] = private_ids(d)
        assert d.engine.bootstraps[decode_pid] == triple
        assert (triple.host, triple.port, str(triple.room)) == ("127.0.0.1", 8998, params["bootstrap_room"])


async def _read_all(call: Any) -> tuple[list[sidecar_pb2.LLMEngineOutput], grpc.aio.AioRpcError | None]:
    outs: list[sidecar_pb2.LLMEngineOutput] = []
    try:
        while (out := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
            outs.append(out)
    except grpc.aio.AioRpcError as err:
        return outs, err
    return outs, None


@TRANSPORTS
async def test_a_prefill_aborted_at_our_request_ends_cancelled_without_a_handoff(
    transport: Transport,
) -> None:
    async with sglang_stack(transport, mode="prefill", bootstrap_port=8998, token_latency_ms=3000) as p:
        call = p.stub.Generate(public_request("pre", max_tokens=8), timeout=20)
        await until(lambda: p.engine.book.running_count == 1, "prefill running")
        reply = await p.stub.Abort(sidecar_pb2.AbortRequest(request_id="pre"), timeout=5)
        assert reply.aborted == 1
        outs, err = await _read_all(call)
        assert err is None, err
        finals = [o for o in outs if o.finish_reason != sidecar_pb2.UNSPECIFIED]
        assert [o.finish_reason for o in finals] == [sidecar_pb2.CANCELLED]
        assert not finals[0].HasField("disaggregated_params"), "an aborted prefill hands nothing off"
        assert outs[-1] is finals[0]
        [pid] = private_ids(p)
        await _only_target_aborted(p, pid)


@TRANSPORTS
async def test_a_prefill_the_engine_aborts_on_its_own_keeps_the_engines_error(transport: Transport) -> None:
    async with sglang_stack(transport, mode="prefill", bootstrap_port=8998, token_latency_ms=3000) as p:
        call = p.stub.Generate(public_request("pre", max_tokens=8), timeout=20)
        await until(lambda: p.engine.book.running_count == 1, "prefill running")
        [pid] = private_ids(p)
        # SGLang aborting on its own (its own shutdown, an operator's abort, a scheduler limit).
        assert p.engine.abort(pid, source="operator") == [pid]
        outs, err = await _read_all(call)
        assert err is not None, "an abort nobody asked for is an error, not a finished prefill"
        assert all(o.finish_reason == sidecar_pb2.UNSPECIFIED for o in outs)
        assert err.code() == grpc.StatusCode.UNKNOWN, err.details()
        assert reason_of(err) == ("UNKNOWN", "false")
        assert "engine aborted the request" in (err.details() or "")


# ---------------------------------------------------------------------------- failures


@TRANSPORTS
@pytest.mark.parametrize(
    ("plan", "prefix", "code", "reason", "migratable"),
    [
        (FaultPlan(FaultKind.FAIL_OPEN), 0, grpc.StatusCode.UNAVAILABLE, "CANNOT_CONNECT", "true"),
        (
            FaultPlan(FaultKind.CLOSE_AFTER, after=3),
            3,
            grpc.StatusCode.UNAVAILABLE,
            "ENGINE_SHUTDOWN",
            "true",
        ),
        (FaultPlan(FaultKind.ERROR_AFTER, after=2), 2, grpc.StatusCode.UNKNOWN, "UNKNOWN", "false"),
        (
            FaultPlan(FaultKind.MALFORMED_TERMINAL, variant="missing_finish_reason"),
            4,
            grpc.StatusCode.INTERNAL,
            "PROTOCOL_ERROR",
            "false",
        ),
        (
            FaultPlan(FaultKind.MALFORMED_TERMINAL, variant="unknown_finish_reason"),
            4,
            grpc.StatusCode.INTERNAL,
            "PROTOCOL_ERROR",
            "false",
        ),
        (
            FaultPlan(FaultKind.MALFORMED_TERMINAL, variant="negative_id"),
            4,
            grpc.StatusCode.INTERNAL,
            "PROTOCOL_ERROR",
            "false",
        ),
        (
            FaultPlan(FaultKind.MALFORMED_TERMINAL, variant="count_mismatch"),
            4,
            grpc.StatusCode.INTERNAL,
            "PROTOCOL_ERROR",
            "false",
        ),
    ],
)
async def test_engine_failure_gives_the_exact_prefix_then_a_typed_status(
    transport: Transport, plan: FaultPlan, prefix: int, code: grpc.StatusCode, reason: str, migratable: str
) -> None:
    async with sglang_stack(transport) as s:
        s.engine.faults.add("-bad", plan)
        outs, err = await collect_until_error(
            s.stub.Generate(public_request("bad", max_tokens=5), timeout=10)
        )
        full = expected(s, max_tokens=5)
        if (
            transport == "http"
            and plan.variant == "missing_finish_reason"
            and plan.kind is FaultKind.MALFORMED_TERMINAL
        ):
            # SSE has no "finished" flag: a null finish_reason is an ordinary chunk, then [DONE].
            prefix = 5
        assert tokens(outs) == full[:prefix]
        assert all(o.finish_reason == sidecar_pb2.UNSPECIFIED for o in outs)
        assert err.code() == code, err.details()
        assert reason_of(err) == (reason, migratable)
        # Whatever broke (a malformed terminal included), a generation that ends without its
        # terminal delivered is aborted on the engine exactly once, before the call ends.
        assert await s.server.wait_idle(5)
        [bad] = private_ids(s)
        assert s.engine.book.aborts == [bad]
        again = await collect(s.stub.Generate(public_request("good", max_tokens=5), timeout=10))
        assert tokens(again) == full
        await idle(s)


@TRANSPORTS
async def test_repeat_after_terminal_is_not_a_second_terminal(transport: Transport) -> None:
    async with sglang_stack(transport) as s:
        s.engine.faults.add("-rep", FaultPlan(FaultKind.REPEAT_AFTER_TERMINAL))
        outs = await collect(s.stub.Generate(public_request("rep", max_tokens=4), timeout=10))
        assert tokens(outs) == expected(s, max_tokens=4)
        terminal(outs, last=True)


@TRANSPORTS
async def test_engine_rejection_is_invalid_argument(transport: Transport) -> None:
    async with sglang_stack(transport) as s:
        outs, err = await collect_until_error(s.stub.Generate(public_request(token_ids=[99999]), timeout=10))
        assert outs == []
        # HTTP says 400; SGLang's gRPC server reports a refused submit as INTERNAL, and the
        # sidecar reads this refusal's sentence there as the client's mistake too.
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (
            err.details() == "input_ids contains out-of-vocabulary token id 99999; valid range is [0, 32000)."
        )


@TRANSPORTS
async def test_logit_bias_is_carried_over_http_and_checked_by_the_engine(transport: Transport) -> None:
    async with sglang_stack(transport) as s:
        good = public_request("bias", max_tokens=3)
        good.sampling_options.logit_bias[7] = 2.5
        bad = public_request("bias-oov", max_tokens=3)
        bad.sampling_options.logit_bias[s.engine.config.vocab_size] = 1.0
        if transport == "grpc":
            for req in (good, bad):
                outs, err = await collect_until_error(s.stub.Generate(req, timeout=10))
                assert (outs, err.code()) == ([], grpc.StatusCode.INVALID_ARGUMENT)
                assert (err.details() or "").startswith("sampling_options.logit_bias: "), err.details()
            assert s.engine.book.received == [], "SGLang's gRPC wire has no logit_bias: refused before it"
            return
        outs = await collect(s.stub.Generate(good, timeout=10))
        assert tokens(outs) == expected(s, max_tokens=3)
        [(_, sent)] = s.engine.book.received
        assert isinstance(sent, dict)
        assert sent["sampling_params"]["logit_bias"] == {"7": 2.5}
        outs, err = await collect_until_error(s.stub.Generate(bad, timeout=10))
        assert (outs, err.code()) == ([], grpc.StatusCode.INVALID_ARGUMENT)
        vocab = s.engine.config.vocab_size
        assert f"logit_bias must has keys in [0, {vocab - 1}], got {vocab}." in (err.details() or "")


LORA_OFF = (
    "LoRA adapter 'sql' was requested, but LoRA is not enabled. Please launch the server with "
    "--enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."
)


def error_metadata(err: grpc.aio.AioRpcError) -> dict[str, str]:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    return dict(info.metadata)


@TRANSPORTS
async def test_a_lora_adapter_while_lora_is_off_is_refused_the_same_on_both_wires(
    transport: Transport,
) -> None:
    # SGLang refuses it with a ValueError: HTTP 400, but gRPC INTERNAL like any failure. Its
    # server info says LoRA is off, so the sidecar refuses first, in SGLang's words.
    async with sglang_stack(transport) as s:
        req = public_request("lora", max_tokens=2)
        req.routing.lora_name = "sql"
        outs, err = await collect_until_error(s.stub.Generate(req, timeout=10))
        assert outs == []
        assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT, LORA_OFF)
        assert error_metadata(err) == {
            "migratable": "false",
            "origin": "engine",
            "engine_call": "Generate",
            "engine_status": "not sent",
        }
        assert s.engine.book.received == []


@TRANSPORTS
async def test_a_lora_adapter_reaches_an_engine_with_lora_on(transport: Transport) -> None:
    async with sglang_stack(transport, enable_lora=True, lora_paths=("sql",)) as s:
        req = public_request("lora", max_tokens=2)
        req.routing.lora_name = "sql"
        outs = await collect(s.stub.Generate(req, timeout=10))
        assert tokens(outs) == expected(s, max_tokens=2)
        [(_, sent)] = s.engine.book.received
        lora = sent["lora_path"] if isinstance(sent, dict) else getattr(sent, "lora_path", None)
        assert lora == "sql"


@TRANSPORTS
async def test_a_full_queue_is_overloaded_in_the_engines_words(transport: Transport) -> None:
    # SGLang's scheduler turns a request away with a 503 abort when --max-queued-requests wait:
    # the engine is busy, the request is fine.
    async with sglang_stack(transport, max_running_requests=1, max_queued_requests=0) as s:
        s.engine.faults.add("-busy", FaultPlan(FaultKind.HANG, after=1))
        busy = s.stub.Generate(public_request("busy", max_tokens=20), timeout=20)
        await busy.read()
        outs, err = await collect_until_error(s.stub.Generate(public_request("turned-away"), timeout=10))
        assert outs == []
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
        assert reason_of(err) == ("OVERLOADED", "false")
        assert "The request queue is full." in (err.details() or "")
        busy.cancel()
        await idle(s)


# ------------------------------------------------------------------------- cancellation


async def _only_target_aborted(s: Stack, target: str) -> None:
    await idle(s)
    assert s.engine.book.aborts == [target]


@TRANSPORTS
@pytest.mark.parametrize("when", ["before_first_token", "after_first_token"])
async def test_client_cancel_aborts_only_that_request(transport: Transport, when: str) -> None:
    async with sglang_stack(transport, token_latency_ms=20) as s:
        other = s.stub.Generate(public_request("other", max_tokens=30), timeout=20)
        first = await other.read()
        assert first.token_ids
        if when == "before_first_token":
            s.engine.faults.add("-victim", FaultPlan(FaultKind.STALL_FIRST_TOKEN, stall_secs=5))
        call = s.stub.Generate(public_request("victim", max_tokens=1000), timeout=20)
        if when == "after_first_token":
            assert (await call.read()).token_ids
        else:
            await until(lambda: len(private_ids(s)) == 2, "victim reached the engine")
        call.cancel()
        victim = next(pid for pid in private_ids(s) if pid.endswith("-victim"))
        outs = [first, *await collect(other)]
        assert tokens(outs) == expected(s, max_tokens=30)
        await _only_target_aborted(s, victim)


@TRANSPORTS
async def test_abort_gets_through_when_every_connection_is_streaming(transport: Transport) -> None:
    # One engine connection, busy with the stream to stop; SGLang's own abort of a departed
    # HTTP client is pushed out of the test's reach, so only the sidecar's abort can stop it.
    async with sglang_stack(
        transport, connections=1, token_latency_ms=20, disconnect_abort_delay_secs=600
    ) as s:
        call = s.stub.Generate(public_request("victim", max_tokens=1000), timeout=20)
        assert (await call.read()).token_ids
        call.cancel()
        [pid] = private_ids(s)
        await _only_target_aborted(s, pid)


@TRANSPORTS
async def test_a_dropped_client_connection_aborts_the_request(transport: Transport) -> None:
    async with sglang_stack(transport, token_latency_ms=20, disconnect_abort_delay_secs=600) as s:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{s.server.port}")
        try:
            stub: Any = sidecar_pb2_grpc.WorkerStub(channel)
            call = stub.Generate(public_request("dropped", max_tokens=1000), timeout=20)
            assert (await call.read()).token_ids
        finally:
            await channel.close(None)
        [pid] = private_ids(s)
        await _only_target_aborted(s, pid)


@TRANSPORTS
async def test_cancel_while_queued_behind_a_full_scheduler(transport: Transport) -> None:
    async with sglang_stack(transport, max_running_requests=1, token_latency_ms=10) as s:
        busy = s.stub.Generate(public_request("busy", max_tokens=20), timeout=20)
        first = await busy.read()
        queued = s.stub.Generate(public_request("queued", max_tokens=5), timeout=20)
        await until(lambda: s.engine.book.waiting_count == 1, "second request waits for a slot")
        queued.cancel()
        victim = next(pid for pid in private_ids(s) if pid.endswith("-queued"))
        outs = [first, *await collect(busy)]
        assert tokens(outs) == expected(s, max_tokens=20)
        await _only_target_aborted(s, victim)


@TRANSPORTS
async def test_client_deadline_aborts_and_leaves_nothing_running(transport: Transport) -> None:
    async with sglang_stack(transport, token_latency_ms=20) as s:
        _, err = await collect_until_error(s.stub.Generate(public_request(max_tokens=1000), timeout=0.5))
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        [pid] = private_ids(s)
        await _only_target_aborted(s, pid)


@TRANSPORTS
async def test_public_abort_stops_the_engine_request(transport: Transport) -> None:
    async with sglang_stack(transport, token_latency_ms=20) as s:
        call = s.stub.Generate(public_request("victim", max_tokens=1000), timeout=20)
        assert (await call.read()).token_ids
        reply = await s.stub.Abort(sidecar_pb2.AbortRequest(request_id="victim"), timeout=5)
        assert reply.aborted == 1
        with contextlib.suppress(grpc.aio.AioRpcError):
            while await call.read() is not grpc.aio.EOF:  # type: ignore[attr-defined]
                pass
        [pid] = private_ids(s)
        await _only_target_aborted(s, pid)


class TokensAtAbortEngine(SglangTestEngine):
    """Records, for every abort that reaches the engine, how many tokens the request had
    produced by then."""

    def __init__(self, config: SglangEngineConfig) -> None:
        super().__init__(config)
        self.tokens_at_abort: list[int] = []

    def abort(self, rid: str, abort_all: bool = False, *, source: str) -> list[str]:
        live = self._live.get(rid)
        self.tokens_at_abort.append(len(live.state.ids) if live is not None else -1)
        return super().abort(rid, abort_all, source=source)


@TRANSPORTS
@pytest.mark.parametrize(("mode", "holds"), [("decode", True), ("agg", False)])
async def test_decode_holds_a_cancel_until_the_first_token(
    transport: Transport, mode: Any, holds: bool
) -> None:
    engine = TokensAtAbortEngine(
        SglangEngineConfig(disaggregation_mode="decode" if holds else "null", token_latency_ms=5)
    )
    async with sglang_stack(transport, engine, mode=mode) as s:
        s.engine.faults.add("-held", FaultPlan(FaultKind.STALL_FIRST_TOKEN, stall_secs=1.5))
        req = public_request("held", max_tokens=1000)
        if holds:
            req.bootstrap_info.bootstrap_host = "127.0.0.1"
            req.bootstrap_info.bootstrap_port = 8998
            req.bootstrap_info.bootstrap_room = 12345
        call = s.stub.Generate(req, timeout=20)
        await until(lambda: s.engine.book.running_count == 1, "request running")
        call.cancel()
        [pid] = private_ids(s)
        await _only_target_aborted(s, pid)
        assert await s.server.wait_idle(5)
        [produced] = engine.tokens_at_abort
        if holds:
            assert produced >= 1, "the abort waited for the first token (the KV transfer is done)"
        else:
            assert produced == 0, "without the hold the abort cuts the stalled first token short"


@TRANSPORTS
async def test_duplicate_public_ids_are_isolated(transport: Transport) -> None:
    async with sglang_stack(transport, token_latency_ms=5) as s:
        a = s.stub.Generate(public_request("dup", max_tokens=5), timeout=10)
        b = s.stub.Generate(public_request("dup", max_tokens=400), timeout=10)
        assert (await b.read()).token_ids
        b.cancel()
        outs = await collect(a)
        assert tokens(outs) == expected(s, max_tokens=5)
        ids = private_ids(s)
        assert len(set(ids)) == 2
        await idle(s)
        assert len(s.engine.book.aborts) == 1


# ------------------------------------------------------------------------------ refusals


def _refusals() -> list[tuple[str, sidecar_pb2.PreprocessedRequest]]:
    cases: list[tuple[str, sidecar_pb2.PreprocessedRequest]] = [
        ("token_ids", sidecar_pb2.PreprocessedRequest())
    ]

    def case(field: str, mutate: Callable[[sidecar_pb2.PreprocessedRequest], None]) -> None:
        req = public_request()
        mutate(req)
        cases.append((field, req))

    case("sampling_options.n", lambda r: setattr(r.sampling_options, "n", 2))
    case("sampling_options.best_of", lambda r: setattr(r.sampling_options, "best_of", 2))
    case("sampling_options.use_beam_search", lambda r: setattr(r.sampling_options, "use_beam_search", True))
    case("sampling_options.length_penalty", lambda r: setattr(r.sampling_options, "length_penalty", 2.0))
    case(
        "sampling_options.include_stop_str_in_output",
        lambda r: setattr(r.sampling_options, "include_stop_str_in_output", True),
    )
    case(
        "sampling_options.guided_decoding.grammar",
        lambda r: setattr(r.sampling_options.guided_decoding, "grammar", "g"),
    )
    case("extra_args.surprise", lambda r: r.extra_args.update({"surprise": True}))
    case("token_ids", lambda r: r.token_ids.append(2**31))
    return cases


@TRANSPORTS
async def test_every_refused_input_is_refused_before_any_engine_call(transport: Transport) -> None:
    async with sglang_stack(transport) as s:
        for field, req in _refusals():
            outs, err = await collect_until_error(s.stub.Generate(req, timeout=10))
            assert outs == []
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            assert (err.details() or "").startswith(field), (field, err.details())
            assert reason_of(err) == ("INVALID_ARGUMENT", "false")
        media = public_request()
        media.multi_modal_data.add(kind=sidecar_pb2.MultimodalItem.IMAGE, url="https://x/y.png")
        if transport == "grpc":
            _, err = await collect_until_error(s.stub.Generate(media, timeout=10))
            assert (err.details() or "").startswith("multi_modal_data")
        assert s.engine.book.received == []


@TRANSPORTS
async def test_decode_without_a_handoff_is_refused_before_any_engine_call(transport: Transport) -> None:
    async with sglang_stack(transport, mode="decode") as s:
        _, err = await collect_until_error(s.stub.Generate(public_request(), timeout=10))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert s.engine.book.received == []


@TRANSPORTS
async def test_concurrent_generations_are_not_capped_by_the_connection_count(transport: Transport) -> None:
    # Over HTTP/1.1 each stream holds a connection; the engine's scheduler, not the sidecar,
    # must decide how many run. With 2 pool connections, 12 streams all reach the engine.
    async with sglang_stack(transport, connections=2, token_latency_ms=20, max_running_requests=64) as s:
        calls = [s.stub.Generate(public_request(f"wide-{i}", max_tokens=200), timeout=30) for i in range(12)]
        for call in calls:
            assert (await call.read()).token_ids
        assert s.engine.book.running_count == 12
        for call in calls:
            call.cancel()
