"""SGLang ``/generate`` request -> ``sidecar.v1`` sub-requests (pure).

Order of judgment, as the real server's: the body must be JSON (gate 1), fit the request
model (gate 1) and the JSON contract (gate 2); then value checks in the order SGLang's
tokenizer manager makes them (batch shape, ids, then per prompt: context, sampling
``normalize`` then ``verify``), then what the scheduler would refuse at admission, then what
this frontend cannot carry (ours, naming the field). Every refusal happens before any
sub-request exists: nothing reaches a worker.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

import orjson
from pydantic_core import ErrorDetails

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.formats.base import FormatContext, GenerateCall, HttpReply
from sidecar_frontend.formats.sglang_checks import check_contract
from sidecar_frontend.formats.sglang_model import ModelErrors, validate_generate
from sidecar_frontend.formats.sglang_values import (
    DEFAULT_MAX_NEW_TOKENS,
    INT32_MAX,
    SAMPLING_EPS,
    cannot_carry,
    check_chosen_ids,
    check_prompt,
    effective_cap,
    max_new_tokens,
    normalize,
    refuse,
    request_refusals,
    scheduler_checks,
    utf8,
    verify,
)
from sidecar_frontend.formats.sglang_wire import (
    ContractError,
    ValueRefusal,
    contract_error,
    value_error,
)

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "MAX_SAMPLES",
    "ItemPlan",
    "SglangOptions",
    "parse_generate",
    "read_body",
]

# Sub-requests per prompt: each costs a gRPC stream and per-item response state.
MAX_SAMPLES: Final = 1024
_NO_TOKENIZER: Final = (
    "The engine initialized with skip_tokenizer_init=True cannot accept text prompts. "
    "Please provide input_ids or re-initialize the engine with skip_tokenizer_init=False."
)


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


@dataclass(frozen=True)
class SglangOptions:
    items: tuple[ItemPlan, ...]
    # A list response (batch, or n > 1) whose stream events carry "index".
    batch: bool
    incremental: bool
    # Unix seconds at arrival (FormatContext.wall_time), for response_sent_to_client_ts.
    wall_time: float = 0.0


def read_body(body: bytes, headers: Mapping[str, str]) -> object:
    """The body as SGLang's web framework hands it to the request model.

    JSON (parsed with orjson, as SGLang's routes do) when the content type is missing or
    names JSON, else the raw bytes; an empty body or a JSON null is "no body". Where the
    framework itself refuses (a JSON syntax error, no body), the refusal has its shape.
    """
    if not _json_content(headers):
        return body
    try:
        data = orjson.loads(body) if body else None
    except orjson.JSONDecodeError as err:
        invalid: ErrorDetails = {
            "type": "json_invalid",
            "loc": (err.pos,),
            "msg": "JSON decode error",
            "input": {},
            "ctx": {"error": err.msg},
        }
        raise ModelErrors([invalid]) from None
    if data is None:
        raise ModelErrors([{"type": "missing", "loc": (), "msg": "Field required", "input": None}])
    return data


def _json_content(headers: Mapping[str, str]) -> bool:
    """FastAPI parses the body as JSON when there is no content type or a JSON one."""
    value = next((v for k, v in headers.items() if k.lower() == "content-type"), "")
    media = value.split(";", 1)[0].strip().lower()
    return (
        not media
        or media == "application/json"
        or (media.startswith("application/") and media.endswith("+json"))
    )


def parse_generate(
    body: bytes, headers: Mapping[str, str], ctx: FormatContext, *, incremental: bool = False
) -> GenerateCall | HttpReply:
    """``incremental``: the server runs --incremental-streaming-output (a stream's events carry
    only what is new; cumulative otherwise)."""
    try:
        data = read_body(body, headers)
        # SGLang's request dataclass, as its framework's pydantic validates it (every problem listed).
        validate_generate(data)
        assert isinstance(data, dict)  # the dataclass takes nothing else
        check_contract(data)
    except ModelErrors as err:
        return err.reply()
    except ContractError as err:
        return contract_error(err)
    stream = data.get("stream") is True
    try:
        return _plan(data, ctx, stream, incremental)
    except ValueRefusal as err:
        return value_error(str(err), stream=stream)


# ------------------------------------------------------------------ request-level checks


def _per_item(
    data: Mapping[str, object], name: str, default: object, count: int, n: int, single: bool
) -> list[object]:
    """A logprob field: one value for all items, or a list with one per prompt."""
    value = data.get(name)
    if value is None:
        return [default] * count
    if not isinstance(value, list):
        return [value] * count
    if n > 1:
        raise ValueRefusal(f"Cannot use list {name} with parallel_sample_num > 1")
    if len(value) != count:
        what = "a single prompt takes one value" if single else "one value per prompt"
        raise ValueRefusal(f"The length of {name} should be equal to the batch size ({what}).")
    return list(value)


def _sample_count(sampling: object, single: bool) -> int:
    if isinstance(sampling, dict):
        n = sampling.get("n", 1)
    elif isinstance(sampling, list) and sampling:
        n = sampling[0].get("n", 1)
        for params in sampling:
            if params.get("n", 1) != n:
                raise ValueRefusal(
                    "The parallel_sample_num should be the same for all samples in sample params."
                )
    else:
        n = 1
    count = 1 if n is None else n
    assert isinstance(count, int)
    if count > MAX_SAMPLES:
        raise ValueRefusal(f"sampling_params.n must be at most {MAX_SAMPLES}, got {count}.")
    if count < 1 and not single:
        # SGLang fails such a batch with a 500.
        raise ValueRefusal(f"sampling_params.n must be at least 1 for a batch, got {count}.")
    return max(count, 1)


def _rids(
    data: Mapping[str, object], ctx: FormatContext, prompts: int, expanded: int, single: bool
) -> list[str]:
    rid = data.get("rid")
    if single:
        if isinstance(rid, list):
            raise ValueRefusal("rid must be a string for a single prompt, got a list.")
        return [rid or ctx.new_id()] if isinstance(rid, str) else [ctx.new_id()]
    if rid is None:
        return [ctx.new_id() for _ in range(expanded)]
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(expanded)]
    assert isinstance(rid, list)
    if len(rid) != prompts:
        raise ValueRefusal("The specified rids length mismatch with the batch_size for batch processing.")
    counts = Counter(rid)
    duplicates = [item for item, count in counts.items() if count > 1]
    if duplicates:
        raise ValueRefusal(f"Duplicate request IDs detected within the request: {duplicates}")
    return [item or ctx.new_id() for item in rid]


def _chosen_ids(data: Mapping[str, object], prompts: int, n: int, single: bool) -> list[object]:
    """token_ids_logprob per prompt, as SGLang normalises it (checked per prompt later)."""
    value = data.get("token_ids_logprob")
    if not value:
        return [None] * prompts
    if single or not isinstance(value, list) or not isinstance(value[0], list):
        # One prompt keeps what it was given; a flat list is every prompt's.
        return [value] * prompts
    if n > 1:
        raise ValueRefusal("Cannot use list token_ids_logprob with parallel_sample_num > 1")
    if len(value) != prompts:
        # SGLang fails such a batch with a 500.
        raise ValueRefusal("The length of token_ids_logprob should be equal to the batch size.")
    return list(value)


def _lora(data: Mapping[str, object], prompts: int, single: bool) -> list[str | None]:
    lora = data.get("lora_path")
    if lora is None or isinstance(lora, str):
        return [lora] * prompts
    assert isinstance(lora, list)
    if single:
        raise ValueRefusal("lora_path must be a string for a single prompt, got a list.")
    if len(lora) != prompts:
        raise ValueRefusal("The length of lora_path should be equal to the batch size.")
    return [item if isinstance(item, str) else None for item in lora]


# ------------------------------------------------------------------ building sub-requests


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


def _plan(data: Mapping[str, object], ctx: FormatContext, stream: bool, incremental: bool) -> GenerateCall:
    input_ids = data.get("input_ids")
    text, embeds = data.get("text"), data.get("input_embeds")
    if (input_ids is None and text is None and embeds is None) or (
        input_ids is not None and text is not None and embeds is not None
    ):
        raise ValueRefusal("Either text, input_ids or input_embeds should be provided.")
    if input_ids is None:
        if text is not None:
            raise ValueRefusal(_NO_TOKENIZER)
        raise refuse("input_embeds", "only token ids are carried to the workers")
    assert isinstance(input_ids, list)
    if not input_ids:
        raise ValueRefusal("input_ids cannot be empty.")
    single = isinstance(input_ids[0], int)
    prompts: list[list[int]] = [input_ids] if single else input_ids
    sampling = data.get("sampling_params")
    if single and isinstance(sampling, list):
        raise ValueRefusal("sampling_params must be an object for a single prompt, got a list.")
    n = _sample_count(sampling, single)
    batch = not single or n > 1
    count = len(prompts)
    # With n > 1 the samples get fresh ids: the client's rids are only checked.
    unchecked = n > 1 and data.get("rid") is None
    rids = [] if unchecked else _rids(data, ctx, count, count * n, single and n == 1)
    utf8(rids, "rid")
    loras = _lora(data, count, single)
    utf8(loras, "lora_path")
    if isinstance(sampling, list) and len(sampling) != count:
        raise ValueRefusal("The length of sampling_params should be equal to the batch size.")
    # The type gates made sampling_params an object, a list of objects, or null.
    shared: Mapping[str, object] = sampling if isinstance(sampling, dict) else {}
    per_prompt: list[Mapping[str, object]] = sampling if isinstance(sampling, list) else [shared] * count
    logprob = _per_item(data, "return_logprob", False, count, n, single)
    start = _per_item(data, "logprob_start_len", -1, count, n, single)
    top = _per_item(data, "top_logprobs_num", 0, count, n, single)
    chosen = _chosen_ids(data, count, n, single)
    request_refusals(data)
    for rid in rids:
        if rid in ctx.inflight_ids:
            raise ValueRefusal(f"Duplicate request ID detected: {rid}")
    info = ctx.model_info
    context = info.max_context_length
    requests: list[sidecar_pb2.PreprocessedRequest] = []
    items: list[ItemPlan] = []
    for i, prompt in enumerate(prompts):
        params = per_prompt[i]
        check_prompt(None if single else i, prompt)
        wanted = max_new_tokens(params, len(prompt), context)
        check_chosen_ids(chosen[i], info.vocab_size)
        normalize(params)
        verify(params, wanted, info.vocab_size)
        want_logprob = bool(logprob[i])
        start_len = start[i] if want_logprob else -1
        assert isinstance(start_len, int)
        scheduler_checks(len(prompt), context, want_logprob, start_len)
        cannot_carry(params)
        top_n = top[i] if want_logprob else 0
        assert isinstance(top_n, int)
        if top_n < 0 or top_n > INT32_MAX:
            raise refuse("top_logprobs_num", f"it must be between 0 and {INT32_MAX}, got {top_n}")
        cap = effective_cap(wanted, len(prompt), context)
        template = sidecar_pb2.PreprocessedRequest(
            model=info.served_model_name, token_ids=prompt, eos_token_ids=info.eos_token_ids
        )
        _stop_conditions(params, cap, template.stop_conditions)
        _sampling_options(params, template.sampling_options)
        if want_logprob:
            template.output_options.logprobs = top_n
            if 0 <= start_len < len(prompt):
                template.output_options.prompt_logprobs = top_n
            ids = chosen[i]
            if isinstance(ids, list):
                template.output_options.token_ids_logprob.extend(ids)
        if loras[i] is not None:
            template.routing.lora_name = loras[i]  # type: ignore[assignment]
        priority = data.get("priority")
        if isinstance(priority, int):
            template.routing.priority = priority
        for _ in range(n):
            # SGLang gives every parallel sample a fresh id (the client's rid is not used).
            rid = ctx.new_id() if n > 1 else rids[i]
            request = sidecar_pb2.PreprocessedRequest()
            request.CopyFrom(template)
            request.request_id = rid
            requests.append(request)
            items.append(
                ItemPlan(
                    rid=rid,
                    prompt=tuple(prompt),
                    max_new_tokens=cap,
                    return_logprob=want_logprob,
                    top_logprobs_num=top_n,
                    logprob_start_len=start_len,
                    return_prompt_token_ids=data.get("return_prompt_token_ids") is True,
                    token_ids_logprob=want_logprob and bool(chosen[i]),
                    stream_interval=_stream_interval(params),
                )
            )
    options = SglangOptions(
        items=tuple(items),
        batch=batch,
        incremental=incremental,
        wall_time=ctx.wall_time,
    )
    return GenerateCall(requests=tuple(requests), stream=stream, options=options)
