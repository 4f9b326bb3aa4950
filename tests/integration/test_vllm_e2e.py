"""The vLLM sidecar end to end: testkit vLLM engine <- VllmEngine <- SidecarServer <- a real
gRPC client of the public API, all on 127.0.0.1 in one process."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import grpc
import pytest
from google.protobuf import json_format
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from testkit.faults import FaultKind, FaultPlan
from testkit.generator import EOS_TRIGGER_TOKEN, SamplingSpec, detokenize, generate
from testkit.vllm_engine import VllmEngineConfig, VllmTestEngine

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import FailureReason, SidecarError
from sidecar_vllm.engine import VllmEngine
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
from tests.vllm_fixtures import Stack, sidecar_config, vllm_stack

pytestmark = pytest.mark.timeout(60)


def expected(stack: Stack, prompt: list[int] = PROMPT, index: int = 0, **sampling: Any) -> list[int]:
    spec = SamplingSpec(**sampling)
    return [t.token_id for t in generate(stack.engine.config.model, prompt, spec, index)]


# ---------------------------------------------------------------------------- discovery


async def test_model_info_and_load_come_from_the_engine() -> None:
    async with vllm_stack(served_model_name="", data_parallel_size=2, max_num_seqs=7) as s:
        info = await s.stub.GetModelInfo(sidecar_pb2.GetModelInfoRequest(), timeout=5)
        assert info.engine == "vllm"
        assert info.served_model_name == "testkit/tiny-model", "falls back to model_path"
        assert (info.max_context_length, info.vocab_size, list(info.eos_token_ids)) == (4096, 32000, [2])
        assert (info.kv_block_size, info.max_num_seqs, info.data_parallel_size) == (16, 7, 2)
        assert info.disaggregation_mode == "agg"
        assert info.total_kv_blocks == 65536 // 16
        assert info.engine_version == "testkit"
        load = await s.stub.GetLoad(sidecar_pb2.GetLoadRequest(), timeout=5)
        assert [r.dp_rank for r in load.ranks] == [0, 1]
        assert all(r.HasField("kv_usage") and r.running_requests == 0 for r in load.ranks)


@pytest.mark.parametrize(
    ("mode", "role"), [("prefill", "kv_consumer"), ("decode", "kv_producer"), ("prefill", "")]
)
async def test_a_kv_role_that_cannot_serve_the_mode_fails_start_up_naming_both(mode: Any, role: str) -> None:
    engine = VllmTestEngine(VllmEngineConfig(kv_role=role))
    port = await engine.start()
    adapter = VllmEngine(sidecar_config(port, mode))
    try:
        with pytest.raises(SidecarError) as info:
            await adapter.start()
        assert mode in info.value.message
        assert repr(role) in info.value.message
    finally:
        await adapter.close()
        await engine.stop(0)


async def test_no_engine_within_the_deadline_is_cannot_connect() -> None:
    engine = VllmTestEngine(VllmEngineConfig(startup_delay_secs=30))
    port = await engine.start()
    adapter = VllmEngine(sidecar_config(port, deadline=0.5, connections=1))
    try:
        with pytest.raises(SidecarError) as info:
            await adapter.start()
        assert info.value.reason is FailureReason.CANNOT_CONNECT
        assert f"127.0.0.1:{port}" in info.value.message
    finally:
        await adapter.close()
        await engine.stop(0)


async def test_load_reports_the_engines_running_requests_and_kv_usage() -> None:
    async with vllm_stack(token_latency_ms=20, total_kv_tokens=1000) as s:
        call = s.stub.Generate(public_request(max_tokens=1000), timeout=20)
        assert (await call.read()).token_ids
        load = await s.stub.GetLoad(sidecar_pb2.GetLoadRequest(), timeout=5)
        assert load.inflight_requests == 1
        [rank] = load.ranks
        assert (rank.running_requests, rank.waiting_requests) == (1, 0)
        assert 0.0 < rank.kv_usage <= 1.0
        call.cancel()
        await _cancel_case(s)


class SlowToWarmEngine(VllmTestEngine):
    """Serves, but answers HealthCheck "not healthy" for its first ``sick`` probes."""

    def __init__(self, sick: int) -> None:
        super().__init__(VllmEngineConfig())
        self.sick = sick
        self.probes = 0

    async def HealthCheck(self, request: pb.HealthCheckRequest, context: Any) -> pb.HealthCheckResponse:
        self.probes += 1
        if self.probes <= self.sick:
            return pb.HealthCheckResponse(healthy=False, message="warming up")
        reply: pb.HealthCheckResponse = await super().HealthCheck(request, context)
        return reply


class NoServerInfoEngine(VllmTestEngine):
    async def GetServerInfo(self, request: pb.GetServerInfoRequest, context: Any) -> pb.GetServerInfoResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no such method here")
        raise AssertionError("unreachable")


@pytest.mark.parametrize(("sick", "ok"), [(3, True), (10**6, False)])
async def test_start_waits_for_health_within_the_one_startup_deadline(sick: int, ok: bool) -> None:
    engine = SlowToWarmEngine(sick)
    port = await engine.start()
    adapter = VllmEngine(sidecar_config(port, deadline=1.5))
    try:
        if ok:
            await adapter.start()
            assert adapter.model_info().served_model_name == "testkit-model"
            assert engine.probes == sick + 1
        else:
            with pytest.raises(SidecarError) as info:
                await adapter.start()
            assert info.value.reason is FailureReason.CANNOT_CONNECT
            assert "HealthCheck" in info.value.message
            assert "warming up" in info.value.message
            assert "startup deadline 1.5s" in info.value.message
    finally:
        await adapter.close()
        await engine.stop(0)


async def test_a_discovery_failure_fails_start_up_at_once_with_the_engines_words() -> None:
    engine = NoServerInfoEngine(VllmEngineConfig())
    port = await engine.start()
    adapter = VllmEngine(sidecar_config(port, deadline=600))
    try:
        with anyio.fail_after(30), pytest.raises(SidecarError) as info:
            await adapter.start()
        assert info.value.message == "GetServerInfo: no such method here (UNIMPLEMENTED)"
    finally:
        await adapter.close()
        await engine.stop(0)


# ---------------------------------------------------------------------------- generation


async def test_streaming_with_usage() -> None:
    async with vllm_stack() as s:
        outs = await collect(s.stub.Generate(public_request(max_tokens=6), timeout=10))
        assert tokens(outs) == expected(s, max_tokens=6)
        end = terminal(outs)
        assert end is outs[-1]
        assert end.finish_reason == sidecar_pb2.LENGTH
        u = end.completion_usage
        assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (4, 6, 10)
        assert u.HasField("cached_tokens")
        sent = s.engine.book.requests()[0]
        assert isinstance(sent, pb.GenerateRequest)
        assert sent.stream
        assert sent.request_id.endswith("-req")
        assert s.engine.book.aborts == []


async def test_multi_token_chunks_are_not_repeated_by_the_restating_complete() -> None:
    async with vllm_stack(chunk_tokens=4) as s:
        outs = await collect(s.stub.Generate(public_request(max_tokens=10), timeout=10))
        assert tokens(outs) == expected(s, max_tokens=10)
        assert terminal(outs).completion_usage.completion_tokens == 10


async def test_eos_stops_without_a_stop_reason() -> None:
    async with vllm_stack() as s:
        prompt = [EOS_TRIGGER_TOKEN, 3, 500]
        req = public_request(token_ids=prompt, stop_token_ids_hidden=[2], max_tokens=20)
        outs = await collect(s.stub.Generate(req, timeout=10))
        assert len(tokens(outs)) == 3
        assert tokens(outs)[-1] == 2
        end = terminal(outs)
        assert end.finish_reason == sidecar_pb2.STOP
        assert end.WhichOneof("stop_reason") is None


async def test_user_stop_token_is_reported() -> None:
    async with vllm_stack() as s:
        free_run = expected(s, max_tokens=8)
        stop = free_run[4]
        want = free_run[: free_run.index(stop) + 1]
        outs = await collect(s.stub.Generate(public_request(max_tokens=8, stop_token_ids=[stop]), timeout=10))
        assert tokens(outs) == want
        end = terminal(outs)
        assert end.finish_reason == sidecar_pb2.STOP
        assert end.WhichOneof("stop_reason") == "stop_token_id"
        assert end.stop_token_id == stop


async def test_stop_string_is_reported() -> None:
    async with vllm_stack() as s:
        free_run = expected(s, max_tokens=12)
        word = next(detokenize(t) for t in free_run[3:] if len(detokenize(t)) > 1)
        outs = await collect(s.stub.Generate(public_request(max_tokens=12, stop=[word]), timeout=10))
        end = terminal(outs)
        assert end.finish_reason == sidecar_pb2.STOP
        assert end.stop_string == word
        got = tokens(outs)
        assert got == free_run[: len(got)]
        assert len(got) < 12


async def test_logprobs_and_prompt_logprobs() -> None:
    async with vllm_stack() as s:
        req = public_request(max_tokens=4)
        req.output_options.logprobs = 2
        req.output_options.prompt_logprobs = 1
        outs = await collect(s.stub.Generate(req, timeout=10))
        for o in outs:
            assert len(o.log_probs) == len(o.token_ids) == len(o.top_logprobs)
            for tok, lp, top in zip(o.token_ids, o.log_probs, o.top_logprobs, strict=True):
                assert top.entries[0].token_id == tok
                assert top.entries[0].logprob == lp
                assert len({e.token_id for e in top.entries}) == len(top.entries)
        data = json_format.MessageToDict(terminal(outs).engine_data)
        plp = data["prompt_logprobs"]
        assert len(plp) == len(PROMPT)
        assert plp[0] is None
        assert all(str(tok) in pos for tok, pos in zip(PROMPT[1:], plp[1:], strict=True))


async def test_n_2_streams_two_choices() -> None:
    async with vllm_stack() as s:
        req = public_request(max_tokens=5)
        req.sampling_options.n = 2
        outs = await collect(s.stub.Generate(req, timeout=10))
        for i in (0, 1):
            assert tokens(outs, i) == expected(s, index=i, max_tokens=5, n=2)
            assert terminal(outs, i).completion_usage.completion_tokens == 5
        assert tokens(outs, 0) != tokens(outs, 1)


async def test_duplicate_public_ids_are_isolated() -> None:
    async with vllm_stack(token_latency_ms=5) as s:
        a = s.stub.Generate(public_request("dup", max_tokens=5), timeout=10)
        b = s.stub.Generate(public_request("dup", max_tokens=40), timeout=10)
        first_b = await b.read()
        assert first_b.token_ids
        b.cancel()
        outs = await collect(a)
        assert tokens(outs) == expected(s, max_tokens=5)
        ids = private_ids(s)
        assert len(set(ids)) == 2
        await until(lambda: s.engine.book.running_count == 0, "engine idle")
        assert len(s.engine.book.aborts) == 1


# ------------------------------------------------------------------------- disaggregation


async def test_prefill_then_decode_through_two_sidecars() -> None:
    async with (
        vllm_stack(mode="prefill", kv_role="kv_producer", kv_port=5600) as p,
        vllm_stack(mode="decode", kv_role="kv_consumer") as d,
    ):
        assert (await p.stub.GetModelInfo(sidecar_pb2.GetModelInfoRequest())).disaggregation_mode == "prefill"
        pre = await collect(p.stub.Generate(public_request("pd", max_tokens=8), timeout=10))
        assert len(pre) == 1
        handoff = pre[0]
        assert list(handoff.token_ids) == []
        assert handoff.finish_reason != sidecar_pb2.CANCELLED
        assert handoff.completion_usage.completion_tokens == 0
        params = json_format.MessageToDict(handoff.disaggregated_params)
        assert params["remote_port"] == 5600
        sent_prefill = p.engine.book.requests()[0]
        assert isinstance(sent_prefill, pb.GenerateRequest)
        assert json.loads(sent_prefill.kv_transfer_params_json) == {"do_remote_decode": True}
        assert sent_prefill.sampling_params.max_tokens == 1

        req = public_request("pd", max_tokens=8)
        req.prefill_result.disaggregated_params.CopyFrom(handoff.disaggregated_params)
        outs = await collect(d.stub.Generate(req, timeout=10))
        assert len(tokens(outs)) == 8
        assert terminal(outs).finish_reason == sidecar_pb2.LENGTH
        [(_, kv)] = d.engine.handoffs
        assert kv["remote_port"] == "5600"
        assert kv["remote_block_ids"] == params["remote_block_ids"]


async def test_aborted_prefill_ends_cancelled_without_handoff() -> None:
    async with vllm_stack(mode="prefill", kv_role="kv_producer", token_latency_ms=3000) as p:
        call = p.stub.Generate(public_request("pre", max_tokens=8), timeout=20)
        await until(lambda: p.engine.book.running_count == 1, "prefill running")
        # vLLM aborting on its own (e.g. its own shutdown or an operator's abort).
        await p.engine.Abort(pb.AbortRequest(request_ids=private_ids(p)), None)
        outs = await collect(call)
        assert len(outs) == 1
        assert outs[0].finish_reason == sidecar_pb2.CANCELLED
        assert not outs[0].HasField("disaggregated_params")


# ---------------------------------------------------------------------------- failures


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
            FaultPlan(FaultKind.ERROR_AFTER, after=1, code="RESOURCE_EXHAUSTED"),
            1,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "OVERLOADED",
            "false",
        ),
        *(
            (
                FaultPlan(FaultKind.MALFORMED_TERMINAL, variant=v),
                5,
                grpc.StatusCode.INTERNAL,
                "PROTOCOL_ERROR",
                "false",
            )
            for v in ("missing_finish_reason", "unknown_finish_reason", "count_mismatch", "negative_id")
        ),
    ],
)
async def test_engine_failure_gives_the_exact_prefix_then_a_typed_status(
    plan: FaultPlan, prefix: int, code: grpc.StatusCode, reason: str, migratable: str
) -> None:
    async with vllm_stack() as s:
        s.engine.faults.add("-bad", plan)
        outs, err = await collect_until_error(
            s.stub.Generate(public_request("bad", max_tokens=5), timeout=10)
        )
        full = expected(s, max_tokens=5)
        assert tokens(outs) == full[:prefix]
        assert all(o.finish_reason == sidecar_pb2.UNSPECIFIED for o in outs)
        assert err.code() == code
        assert reason_of(err) == (reason, migratable)
        [bad] = private_ids(s)
        assert s.engine.book.aborts == [bad], "a generation left unfinished is aborted exactly once"
        # The next request on the same sidecar works.
        again = await collect(s.stub.Generate(public_request("good", max_tokens=5), timeout=10))
        assert tokens(again) == full
        await until(lambda: s.engine.book.running_count == 0, "engine idle")


async def test_a_hung_engine_stream_ends_at_the_client_deadline_and_is_released() -> None:
    async with vllm_stack() as s:
        s.engine.faults.add("-hung", FaultPlan(FaultKind.HANG, after=2))
        outs, err = await collect_until_error(
            s.stub.Generate(public_request("hung", max_tokens=5), timeout=0.5)
        )
        assert tokens(outs) == expected(s, max_tokens=5)[:2]
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await _cancel_case(s)


async def test_messages_after_the_terminal_are_ignored() -> None:
    async with vllm_stack() as s:
        s.engine.faults.add("-echo", FaultPlan(FaultKind.REPEAT_AFTER_TERMINAL))
        outs = await collect(s.stub.Generate(public_request("echo", max_tokens=5), timeout=10))
        assert tokens(outs) == expected(s, max_tokens=5)
        assert terminal(outs) is outs[-1]
        assert s.engine.book.aborts == []


async def test_engine_dying_mid_stream_is_migratable_and_health_notices() -> None:
    async with vllm_stack(token_latency_ms=20) as s:
        assert (await s.adapter.health()).healthy
        call = s.stub.Generate(public_request(max_tokens=1000), timeout=10)
        assert (await call.read()).token_ids
        await s.engine.die()
        _, err = await collect_until_error(call)
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert reason_of(err)[1] == "true"
        assert not (await s.adapter.health()).healthy
        await s.engine.start()
        with anyio.fail_after(10):
            while not (await s.adapter.health()).healthy:  # noqa: ASYNC110 - a probe, not an event
                await asyncio.sleep(0.05)


async def test_engine_error_status_keeps_the_engines_words() -> None:
    async with vllm_stack() as s:
        s.engine.faults.add("-bad", FaultPlan(FaultKind.ERROR_AFTER, after=1, message="boom in step"))
        _, err = await collect_until_error(s.stub.Generate(public_request("bad", max_tokens=5), timeout=10))
        assert err.details() == "Generate: boom in step (INTERNAL)"


async def test_engine_rejection_is_invalid_argument() -> None:
    async with vllm_stack() as s:
        outs, err = await collect_until_error(s.stub.Generate(public_request(token_ids=[99999]), timeout=10))
        assert outs == []
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "out of vocabulary" in (err.details() or "")


# ------------------------------------------------------------------------- cancellation


async def _cancel_case(s: Stack) -> None:
    await until(lambda: s.engine.book.running_count == 0, "engine idle after the client left")
    [pid] = private_ids(s)
    assert s.engine.book.aborts == [pid]


async def test_client_cancel_leaves_nothing_running_and_aborts_once() -> None:
    async with vllm_stack(token_latency_ms=20) as s:
        call = s.stub.Generate(public_request(max_tokens=1000), timeout=20)
        assert (await call.read()).token_ids
        call.cancel()
        await _cancel_case(s)
        # Once the handler is done with the call nothing can abort it again.
        assert await s.server.wait_idle(5)
        assert len(s.engine.book.aborts) == 1


async def test_client_deadline_leaves_nothing_running_and_aborts_once() -> None:
    async with vllm_stack(token_latency_ms=20) as s:
        call = s.stub.Generate(public_request(max_tokens=1000), timeout=0.5)
        _, err = await collect_until_error(call)
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await _cancel_case(s)


async def test_public_abort_stops_the_engine_request() -> None:
    async with vllm_stack(token_latency_ms=20) as s:
        call = s.stub.Generate(public_request("victim", max_tokens=1000), timeout=20)
        assert (await call.read()).token_ids
        reply = await s.stub.Abort(sidecar_pb2.AbortRequest(request_id="victim"), timeout=5)
        assert reply.aborted == 1
        with contextlib.suppress(grpc.aio.AioRpcError):
            await collect(call)
        await _cancel_case(s)


async def test_drain_past_its_timeout_aborts_the_engine_request_once() -> None:
    async with vllm_stack(token_latency_ms=20, drain_timeout=0.3) as s:
        call = s.stub.Generate(public_request("long", max_tokens=1000), timeout=20)
        assert (await call.read()).token_ids
        await s.server.drain()
        _, err = await collect_until_error(call)
        assert err.code() != grpc.StatusCode.OK
        await _cancel_case(s)
        _, refused = await collect_until_error(s.stub.Generate(public_request("late"), timeout=5))
        assert reason_of(refused) == ("ENGINE_SHUTDOWN", "true")
        assert len(private_ids(s)) == 1, "a refused request never reaches the engine"


class OrderedEngine(VllmTestEngine):
    """Records, in order, the first token sent and every abort received."""

    def __init__(self, config: VllmEngineConfig) -> None:
        super().__init__(config)
        self.events: list[str] = []

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> AsyncIterator[pb.GenerateResponse]:
        async for msg in super().Generate(request, context):
            if msg.WhichOneof("response") == "chunk" and msg.chunk.token_ids and "token" not in self.events:
                self.events.append("token")
            yield msg

    async def Abort(self, request: pb.AbortRequest, context: Any) -> pb.AbortResponse:
        self.events.append("abort")
        reply: pb.AbortResponse = await super().Abort(request, context)
        return reply


@pytest.mark.parametrize(("mode", "order"), [("decode", ["token", "abort"]), ("agg", ["abort"])])
async def test_decode_holds_a_cancel_until_the_first_token(mode: Any, order: list[str]) -> None:
    role = "kv_consumer" if mode == "decode" else ""
    engine = OrderedEngine(VllmEngineConfig(kv_role=role, token_latency_ms=5))
    engine.faults.add("-held", FaultPlan(FaultKind.STALL_FIRST_TOKEN, stall_secs=1.5))
    async with vllm_stack(engine, mode=mode) as s:
        req = public_request("held", max_tokens=1000)
        if mode == "decode":
            req.prefill_result.disaggregated_params.update({"engine_id": "x"})
        call = s.stub.Generate(req, timeout=20)
        await until(lambda: s.engine.book.running_count == 1, "request running")
        call.cancel()
        await _cancel_case(s)
        assert engine.events[: len(order)] == order


async def test_media_on_a_vision_model_reaches_the_engine_as_references() -> None:
    async with vllm_stack(supports_vision=True) as s:
        req = public_request(max_tokens=2)
        req.multi_modal_data.add(kind=sidecar_pb2.MultimodalItem.IMAGE, url="https://x/cat.png")
        outs = await collect(s.stub.Generate(req, timeout=10))
        assert terminal(outs).finish_reason == sidecar_pb2.LENGTH
        sent = s.engine.book.requests()[0]
        assert isinstance(sent, pb.GenerateRequest)
        assert [item.url for item in sent.media_refs.items] == ["https://x/cat.png"]


# ------------------------------------------------------------------------------ refusals


def _refusals() -> list[tuple[str, sidecar_pb2.PreprocessedRequest]]:
    cases: list[tuple[str, sidecar_pb2.PreprocessedRequest]] = [
        ("token_ids", sidecar_pb2.PreprocessedRequest())
    ]

    def case(field: str, mutate: Callable[[sidecar_pb2.PreprocessedRequest], None]) -> None:
        req = public_request()
        mutate(req)
        cases.append((field, req))

    case("sampling_options.best_of", lambda r: setattr(r.sampling_options, "best_of", 2))
    case("sampling_options.use_beam_search", lambda r: setattr(r.sampling_options, "use_beam_search", True))
    case("sampling_options.length_penalty", lambda r: setattr(r.sampling_options, "length_penalty", 2.0))
    case("sampling_options.seed", lambda r: setattr(r.sampling_options, "seed", 2**40))
    case("sampling_options.top_k", lambda r: setattr(r.sampling_options, "top_k", -5))
    case("sampling_options.top_p", lambda r: setattr(r.sampling_options, "top_p", 0.0))
    case(
        "sampling_options.repetition_penalty",
        lambda r: setattr(r.sampling_options, "repetition_penalty", 0.0),
    )
    case("output_options.logprobs", lambda r: setattr(r.output_options, "logprobs", 2**31))
    case("extra_args.surprise", lambda r: r.extra_args.update({"surprise": True}))
    case("routing.lora_name", lambda r: setattr(r.routing, "lora_name", "l"))
    case("routing.priority", lambda r: setattr(r.routing, "priority", 3))
    case("routing.cache_namespace", lambda r: setattr(r.routing, "cache_namespace", "t"))

    def guided_backend(r: sidecar_pb2.PreprocessedRequest) -> None:
        r.sampling_options.guided_decoding.regex = "a"
        r.sampling_options.guided_decoding.backend = "x"

    case("sampling_options.guided_decoding.backend", guided_backend)
    case(
        "multi_modal_data",
        lambda r: (
            r.multi_modal_data.add(kind=sidecar_pb2.MultimodalItem.IMAGE, url="https://x/y.png") and None
        ),
    )
    case("prefill_result", lambda r: r.prefill_result.disaggregated_params.update({"a": 1}))
    return cases


async def test_every_refused_input_is_refused_before_any_engine_call() -> None:
    async with vllm_stack() as s:
        for field, req in _refusals():
            outs, err = await collect_until_error(s.stub.Generate(req, timeout=10))
            assert outs == []
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            assert (err.details() or "").startswith(field), (field, err.details())
            assert reason_of(err) == ("INVALID_ARGUMENT", "false")
        assert s.engine.book.received == []


async def test_decode_without_a_handoff_is_refused_before_any_engine_call() -> None:
    async with vllm_stack(mode="decode", kv_role="kv_both") as s:
        _, err = await collect_until_error(s.stub.Generate(public_request(), timeout=10))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (err.details() or "").startswith("prefill_result.disaggregated_params")
        assert s.engine.book.received == []
