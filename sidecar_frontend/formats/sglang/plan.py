"""An SGLang ``/generate`` body the checks passed -> ``sidecar.v1`` sub-requests (pure).

The last stage of :func:`~sidecar_frontend.formats.sglang.validate.validate`: it refuses
nothing (every check ran before it), it only builds. A batch of P prompts with n samples
gives P*n sub-requests, prompt-major, each with the id the client sees. A non-streaming
request asks each worker for one answer (``OutputOptions.unary``). ``return_routed_experts``
and a non-zero ``routed_experts_start_len`` go to every sub-request (a worker whose wire
cannot carry them refuses them by name: docs/metadata.md), and so does
``sampling_params.custom_params``, as ``extra_args.custom_params``, and ``return_sampling_mask``
/ ``sampling_logprobs_mode``, as ``extra_args`` of those names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sidecar_common.api import sidecar_pb2
from sidecar_common.structs import struct_from_json
from sidecar_frontend.formats.base import FormatContext, GenerateCall
from sidecar_frontend.formats.sglang.values import INT32_MAX, SAMPLING_EPS

__all__ = ["Batch", "ItemPlan", "PromptPlan", "SglangOptions", "plan"]


@dataclass(frozen=True)
class ItemPlan:
    """What the encoder needs to answer for one sub-request."""

    rid: str
    prompt: tuple[int, ...]
    # The effective cap sent to the worker (None: unlimited); finish_reason.length reports it.
    max_new_tokens: int | None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # -1: output logprobs only; k >= 0: prompt logprobs for positions k..end.
    logprob_start_len: int = -1
    return_prompt_token_ids: bool = False
    # Streams: the first tokens at once, then an event once this many are unsent, and the end.
    stream_interval: int = 1
    # SGLang's token_ids_logprob was asked (with return_logprob): its two meta lists are shown.
    token_ids_logprob: bool = False
    # return_routed_experts was asked: the final output shows what the worker returned.
    return_routed_experts: bool = False
    # return_sampling_mask was asked: the events show the masks the worker returned.
    return_sampling_mask: bool = False


@dataclass(frozen=True)
class SglangOptions:
    items: tuple[ItemPlan, ...]
    # A list response (batch, or n > 1) whose stream events carry "index".
    batch: bool
    incremental: bool
    # Unix seconds at arrival (FormatContext.wall_time), for response_sent_to_client_ts.
    wall_time: float = 0.0


@dataclass(frozen=True)
class Batch:
    """What the batch stage found: the prompts and each one's request-level values."""

    prompts: Sequence[Sequence[int]]
    # One prompt (``input_ids`` a flat list): the response is one object unless n > 1.
    single: bool
    n: int  # samples per prompt
    # One per prompt (empty with n > 1: each sample gets a fresh id).
    rids: Sequence[str]
    loras: Sequence[str | None]
    params: Sequence[Mapping[str, object]]  # each prompt's sampling_params
    # Each prompt's logprob fields (one value for all, or one per prompt, as sent).
    return_logprob: Sequence[object]
    logprob_start_len: Sequence[object]
    top_logprobs_num: Sequence[object]
    # Each prompt's token_ids_logprob (None: not asked).
    chosen: Sequence[object]
    # Each prompt's return_sampling_mask and sampling_logprobs_mode (empty: none asked).
    sampling_mask: Sequence[object] = ()
    sampling_logprobs_mode: Sequence[object] = ()


@dataclass(frozen=True)
class PromptPlan:
    """What the prompt stage found for one prompt."""

    # The effective cap (None: unlimited).
    cap: int | None
    return_logprob: bool
    logprob_start_len: int  # -1 unless return_logprob
    top_logprobs_num: int  # 0 unless return_logprob


def _sampling_options(params: Mapping[str, object], out: sidecar_pb2.SamplingOptions) -> None:
    for name in ("top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        value = params.get(name)
        if value is not None:
            setattr(out, name, float(value))  # type: ignore[arg-type]
    temperature = params.get("temperature")
    greedy = isinstance(temperature, int | float) and 0 <= temperature < SAMPLING_EPS
    if temperature is not None:
        out.temperature = float(temperature)  # type: ignore[arg-type]
    top_k = params.get("top_k")
    if isinstance(top_k, int):
        # SGLang itself samples greedily with top_k 1 there; a top_k past int32 means "all".
        out.top_k = 1 if greedy else (-1 if top_k > INT32_MAX else top_k)
    seed = params.get("sampling_seed")
    if isinstance(seed, int):
        out.seed = seed
    bias = params.get("logit_bias")
    if isinstance(bias, dict):
        for key, value in bias.items():
            out.logit_bias[int(key)] = float(value)
    guided = out.guided_decoding
    if params.get("json_schema"):
        guided.json = str(params["json_schema"])
    elif params.get("regex"):
        guided.regex = str(params["regex"])
    elif params.get("ebnf"):
        guided.grammar = str(params["ebnf"])
    elif params.get("structural_tag"):
        guided.structural_tag = str(params["structural_tag"])


def _stop_conditions(
    params: Mapping[str, object], max_new: int | None, out: sidecar_pb2.StopConditions
) -> None:
    if max_new is not None:
        out.max_tokens = max_new
    ignore_eos = params.get("ignore_eos")
    if isinstance(ignore_eos, bool):
        out.ignore_eos = ignore_eos
    if ignore_eos is not True:
        # SGLang's scheduler skips the stop-token check under ignore_eos: so do we, for
        # every engine behind the frontend.
        stops = params.get("stop_token_ids") or []
        assert isinstance(stops, list)
        out.stop_token_ids.extend(dict.fromkeys(stops))


def _stream_interval(params: Mapping[str, object]) -> int:
    interval = params.get("stream_interval")
    return interval if isinstance(interval, int) and interval > 1 else 1


def plan(
    data: Mapping[str, object],
    batch: Batch,
    prompts: Sequence[PromptPlan],
    ctx: FormatContext,
    *,
    stream: bool,
    incremental: bool,
) -> GenerateCall:
    """The sub-requests, prompt-major, and what the encoder needs to answer them."""
    info = ctx.model_info
    n = batch.n
    requests: list[sidecar_pb2.PreprocessedRequest] = []
    items: list[ItemPlan] = []
    for i, (prompt, checked) in enumerate(zip(batch.prompts, prompts, strict=True)):
        params = batch.params[i]
        template = sidecar_pb2.PreprocessedRequest(
            model=info.served_model_name, token_ids=prompt, eos_token_ids=info.eos_token_ids
        )
        _stop_conditions(params, checked.cap, template.stop_conditions)
        _sampling_options(params, template.sampling_options)
        # A non-streaming request is one answer: so is what each worker is asked for (its
        # engine too). A worker that streams anyway is joined the same way by the encoder.
        if not stream:
            template.output_options.unary = True
        if checked.return_logprob:
            template.output_options.logprobs = checked.top_logprobs_num
            if 0 <= checked.logprob_start_len < len(prompt):
                template.output_options.prompt_logprobs = checked.top_logprobs_num
            ids = batch.chosen[i]
            if isinstance(ids, list):
                template.output_options.token_ids_logprob.extend(ids)
        custom = params.get("custom_params")
        if isinstance(custom, dict):
            # SGLang's own parameters for its sampling (values checked them).
            template.extra_args.fields["custom_params"].struct_value.CopyFrom(struct_from_json(custom))
        asks_mask = i < len(batch.sampling_mask) and batch.sampling_mask[i] is True
        if asks_mask:
            template.extra_args.fields["return_sampling_mask"].bool_value = True
        mode = batch.sampling_logprobs_mode[i] if i < len(batch.sampling_logprobs_mode) else None
        if isinstance(mode, str):
            template.extra_args.fields["sampling_logprobs_mode"].string_value = mode
        if data.get("return_routed_experts") is True:
            template.output_options.return_routed_experts = True
        start = data.get("routed_experts_start_len")
        if isinstance(start, int) and start != 0:
            # SGLang checks the start with or without the flag: it goes to the worker as asked.
            template.output_options.routed_experts_start_len = start
        lora = batch.loras[i]
        if lora is not None:
            template.routing.lora_name = lora
        priority = data.get("priority")
        if isinstance(priority, int):
            template.routing.priority = priority
        for _ in range(n):
            # SGLang gives every parallel sample a fresh id (the client's rid is not used).
            rid = ctx.new_id() if n > 1 else batch.rids[i]
            request = sidecar_pb2.PreprocessedRequest()
            request.CopyFrom(template)
            request.request_id = rid
            requests.append(request)
            items.append(
                ItemPlan(
                    rid=rid,
                    prompt=tuple(prompt),
                    max_new_tokens=checked.cap,
                    return_logprob=checked.return_logprob,
                    top_logprobs_num=checked.top_logprobs_num,
                    logprob_start_len=checked.logprob_start_len,
                    return_prompt_token_ids=data.get("return_prompt_token_ids") is True,
                    token_ids_logprob=checked.return_logprob and bool(batch.chosen[i]),
                    stream_interval=_stream_interval(params),
                    return_routed_experts=data.get("return_routed_experts") is True,
                    return_sampling_mask=asks_mask,
                )
            )
    options = SglangOptions(
        items=tuple(items),
        batch=not batch.single or n > 1,
        incremental=incremental,
        wall_time=ctx.wall_time,
    )
    return GenerateCall(requests=tuple(requests), stream=stream, options=options)
