"""SGLang ``/generate``: the stages a body goes through, in one order (pure).

:func:`read` parses the body once, as SGLang's web framework does (the handler reads the
model a body names from it before choosing the model to run on); :func:`validate` then runs
:data:`STAGES`, in this order, the order of the real server's judgment:

1. ``model``: SGLang's request dataclass, as its framework's pydantic validates it (every
   problem listed; ``model.py``, with the ``input_ids`` validator of ``checks.py``).
2. ``contract``: the JSON contract gate, strict JSON types in the body's key order (the first
   problem; ``checks.py``).
3. ``batch``: the request-level values, as SGLang's tokenizer manager checks them: the
   prompts' shape, ``n``, the ids, the per-prompt fields, then the request-level refusals
   (SGLang's and this frontend's) and the ids already in flight (:func:`check_batch`, with
   the sentences of ``values.py``).
4. ``prompts``: per prompt, in SGLang's order: the prompt, the context, ``token_ids_logprob``,
   sampling ``normalize`` then ``verify``, what the scheduler refuses at admission, then what
   this frontend cannot carry (ours, naming the field; :func:`check_prompts`, with the
   sentences of ``values.py``).
5. ``plan``: the sub-requests (``plan.py``; it refuses nothing, so every refusal comes
   before any sub-request exists).

The first refusal is the answer; every refusal happens before any sub-request exists, so
nothing reaches a worker.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final, NamedTuple

import orjson
from pydantic_core import ErrorDetails

from sidecar_frontend.formats.base import FormatContext, GenerateBody, GenerateCall, HttpReply, named_model
from sidecar_frontend.formats.sglang.checks import check_contract
from sidecar_frontend.formats.sglang.model import ModelErrors, validate_generate
from sidecar_frontend.formats.sglang.plan import Batch, PromptPlan, plan
from sidecar_frontend.formats.sglang.values import (
    INT32_MAX,
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
from sidecar_frontend.formats.sglang.wire import (
    ContractError,
    ValueRefusal,
    contract_error,
    value_error,
)

__all__ = [
    "MAX_SAMPLES",
    "STAGES",
    "Draft",
    "Stage",
    "check_batch",
    "check_prompts",
    "read",
    "read_body",
    "validate",
]

# Sub-requests per prompt: each costs a gRPC stream and per-item response state.
MAX_SAMPLES: Final = 1024
_NO_TOKENIZER: Final = (
    "The engine initialized with skip_tokenizer_init=True cannot accept text prompts. "
    "Please provide input_ids or re-initialize the engine with skip_tokenizer_init=False."
)


# ------------------------------------------------------------------ read: once, before the stages


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


def read(body: bytes, headers: Mapping[str, str]) -> GenerateBody | HttpReply:
    """The body parsed once (:func:`read_body`), with the model it names, or its refusal."""
    try:
        data = read_body(body, headers)
    except ModelErrors as err:
        return err.reply()
    return GenerateBody(data, named_model(data))


# ------------------------------------------------------------------ the stages, in order


@dataclass
class Draft:
    """One body on its way through the stages: what each stage found, for those after it."""

    data: object  # the body as the framework parsed it (read)
    ctx: FormatContext
    incremental: bool
    fields: Mapping[str, object] = field(default_factory=dict)  # model: a JSON object
    stream: bool = False  # contract
    batch: Batch | None = None
    prompts: tuple[PromptPlan, ...] = ()
    call: GenerateCall | None = None  # plan


class Stage(NamedTuple):
    name: str
    run: Callable[[Draft], None]


def _model(draft: Draft) -> None:
    validate_generate(draft.data)
    assert isinstance(draft.data, dict)  # the dataclass takes nothing else
    draft.fields = draft.data


def _contract(draft: Draft) -> None:
    check_contract(draft.fields)
    draft.stream = draft.fields.get("stream") is True


def _batch(draft: Draft) -> None:
    draft.batch = check_batch(draft.fields, draft.ctx)


def _prompts(draft: Draft) -> None:
    assert draft.batch is not None
    draft.prompts = check_prompts(draft.batch, draft.ctx)


def _plan(draft: Draft) -> None:
    assert draft.batch is not None
    draft.call = plan(
        draft.fields,
        draft.batch,
        draft.prompts,
        draft.ctx,
        stream=draft.stream,
        incremental=draft.incremental,
    )


STAGES: Final[tuple[Stage, ...]] = (
    Stage("model", _model),
    Stage("contract", _contract),
    Stage("batch", _batch),
    Stage("prompts", _prompts),
    Stage("plan", _plan),
)


def validate(
    body: GenerateBody, ctx: FormatContext, *, incremental: bool = False
) -> GenerateCall | HttpReply:
    """``body`` through :data:`STAGES` (the module docstring says what each does): the
    sub-requests, or the first stage's refusal in SGLang's shape for it.

    ``incremental``: the server runs --incremental-streaming-output (a stream's events carry
    only what is new; cumulative otherwise).
    """
    draft = Draft(body.data, ctx, incremental)
    try:
        for stage in STAGES:
            stage.run(draft)
    except ModelErrors as err:
        return err.reply()
    except ContractError as err:
        return contract_error(err)
    except ValueRefusal as err:
        return value_error(str(err), stream=draft.stream)
    assert draft.call is not None
    return draft.call


# ------------------------------------------------------------------ batch: request-level values


def check_batch(data: Mapping[str, object], ctx: FormatContext) -> Batch:
    """The request-level checks, in SGLang's order; what they found for the later stages."""
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
    mask = _per_item(data, "return_sampling_mask", False, count, n, single)
    mode = _per_item(data, "sampling_logprobs_mode", None, count, n, single)
    if any(m is not None and not asked for asked, m in zip(mask, mode, strict=True)):
        # SGLang's tokenizer manager's sentence.
        raise ValueRefusal("sampling_logprobs_mode can only be set when return_sampling_mask=true.")
    request_refusals(data)
    for rid in rids:
        if rid in ctx.inflight_ids:
            raise ValueRefusal(f"Duplicate request ID detected: {rid}")
    return Batch(
        prompts=prompts,
        single=single,
        n=n,
        rids=rids,
        loras=loras,
        params=per_prompt,
        return_logprob=logprob,
        logprob_start_len=start,
        top_logprobs_num=top,
        chosen=chosen,
        sampling_mask=mask,
        sampling_logprobs_mode=mode,
    )


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


# ------------------------------------------------------------------ prompts: per-prompt values


def check_prompts(batch: Batch, ctx: FormatContext) -> tuple[PromptPlan, ...]:
    """Each prompt's checks, in SGLang's order, prompt by prompt (the first refusal wins)."""
    info = ctx.model_info
    context = info.max_context_length
    checked: list[PromptPlan] = []
    for i, prompt in enumerate(batch.prompts):
        params = batch.params[i]
        check_prompt(None if batch.single else i, prompt)
        wanted = max_new_tokens(params, len(prompt), context)
        check_chosen_ids(batch.chosen[i], info.vocab_size)
        normalize(params)
        verify(params, wanted, info.vocab_size)
        want_logprob = bool(batch.return_logprob[i])
        start_len = batch.logprob_start_len[i] if want_logprob else -1
        assert isinstance(start_len, int)
        scheduler_checks(len(prompt), context, want_logprob, start_len)
        cannot_carry(params)
        top_n = batch.top_logprobs_num[i] if want_logprob else 0
        assert isinstance(top_n, int)
        if top_n < 0 or top_n > INT32_MAX:
            raise refuse("top_logprobs_num", f"it must be between 0 and {INT32_MAX}, got {top_n}")
        cap = effective_cap(wanted, len(prompt), context)
        checked.append(PromptPlan(cap, want_logprob, start_len, top_n))
    return tuple(checked)
