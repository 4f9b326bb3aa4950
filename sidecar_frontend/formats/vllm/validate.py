"""vLLM's ``/inference/v1/generate``: the stages a body goes through, in one order (pure).

:func:`read` parses the body once, as vLLM's web framework does (the handler reads the model
a body names from it before choosing the model to run on); :func:`validate` then runs
:data:`STAGES`, in this order, so that the first problem a client hears about is the one the
real server would name:

1. ``model``: vLLM's ``GenerateRequest`` as its pydantic validates it (``model.py``): the
   cache-salt pre-check first, then the field types (every problem listed), with the
   sampling parameters' own checks (``sampling.py``; the first one raises), then the
   whole-body checks.
2. ``serving``: the checks of vLLM's serving handler: the model name, ``n`` against the server's
   ``max_num_seqs``, chosen prompt-logprob ids in a stream, stop strings, the output mode, the
   integers vLLM msgpack-encodes for its engine.
3. ``engine``: the engine's input checks that what the workers serve lets us make here, in
   the engine's order: the sampling parameters' vocabulary and structured outputs, the
   data-parallel rank, the prompt's length, the prompt's vocabulary (``checks.py``).
4. ``uncarried``: what this frontend cannot carry to a vLLM sidecar, refused by name, so
   nothing is dropped silently.
5. ``plan``: the sub-request (``plan.py``); a value that does not fit its ``sidecar.v1`` field
   is refused by name as it is written.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Final, NamedTuple

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.formats.base import FormatContext, GenerateBody, GenerateCall, HttpReply, named_model
from sidecar_frontend.formats.vllm.checks import check_msgpack, check_prompt, dp_rank, header, read_body
from sidecar_frontend.formats.vllm.errors import (
    Invalid,
    Refused,
    VllmError,
    bad_request,
    uncarried,
    validation_reply,
)
from sidecar_frontend.formats.vllm.model import GenerateRequest, validate_generate
from sidecar_frontend.formats.vllm.plan import plan
from sidecar_frontend.formats.vllm.sampling import UINT32_MAX
from sidecar_frontend.formats.vllm.sampling import SamplingParams as SamplingChecks

__all__ = [
    "STAGES",
    "Draft",
    "Stage",
    "engine_input_checks",
    "read",
    "refuse_uncarried",
    "serving_checks",
    "validate",
]

_INT32_MAX: Final = 2**31 - 1


def read(body: bytes, headers: Mapping[str, str]) -> GenerateBody | HttpReply:
    """The body parsed once, as vLLM's framework reads it (``checks.read_body``: the content
    type, the JSON), with the model it names, or its refusal."""
    try:
        data = read_body(body, headers)
    except Refused as refused:
        return refused.reply
    except Invalid as invalid:
        return validation_reply(invalid.issues)
    return GenerateBody(data, named_model(data))


# ------------------------------------------------------------------ the stages, in order


@dataclass
class Draft:
    """One body on its way through the stages: what each stage found, for those after it."""

    data: object  # the body as the framework parsed it (read)
    headers: Mapping[str, str]
    ctx: FormatContext
    body: GenerateRequest | None = None  # model
    rank: int | None = None  # engine: the data-parallel rank asked for
    call: GenerateCall | None = None  # plan


class Stage(NamedTuple):
    name: str
    run: Callable[[Draft], None]


def _model(draft: Draft) -> None:
    draft.body = validate_generate(draft.data)


def _serving(draft: Draft) -> None:
    assert draft.body is not None
    serving_checks(draft.body, draft.ctx.model_info)


def _engine(draft: Draft) -> None:
    assert draft.body is not None
    body = draft.body
    draft.rank = engine_input_checks(
        body.sampling_params.checked, body.token_ids, draft.headers, draft.ctx.model_info
    )


def _uncarried(draft: Draft) -> None:
    assert draft.body is not None
    refuse_uncarried(draft.body)


def _plan(draft: Draft) -> None:
    assert draft.body is not None
    draft.call = plan(draft.body, draft.headers, draft.ctx, draft.rank)


STAGES: Final[tuple[Stage, ...]] = (
    Stage("model", _model),
    Stage("serving", _serving),
    Stage("engine", _engine),
    Stage("uncarried", _uncarried),
    Stage("plan", _plan),
)


def validate(body: GenerateBody, headers: Mapping[str, str], ctx: FormatContext) -> GenerateCall | HttpReply:
    """``body`` through :data:`STAGES` (the module docstring says what each does): the
    sub-request, or the first refusal in vLLM's shape."""
    draft = Draft(body.data, headers, ctx)
    try:
        for stage in STAGES:
            stage.run(draft)
    except Refused as refused:
        return refused.reply
    except Invalid as invalid:
        return validation_reply(invalid.issues)
    assert draft.call is not None
    return draft.call


# ------------------------------------------------------------------ serving


def serving_checks(body: GenerateRequest, info: sidecar_pb2.ModelInfo) -> None:
    """vLLM's serving handler's checks, in its order; raises the first refusal."""
    params = body.sampling_params.checked
    served = info.served_model_name
    if body.model and body.model != served:
        raise Refused(
            VllmError(
                f"The model `{body.model}` does not exist. Valid aliases: {served}.",
                "NotFoundError",
                HTTPStatus.NOT_FOUND,
                "model",
            )
        )
    max_num_seqs = info.max_num_seqs
    if max_num_seqs and params.n > max_num_seqs:
        raise Refused(
            bad_request(
                "sampling_params.n must be at most the server's max_num_seqs "
                f"({max_num_seqs}), got {params.n}."
            )
        )
    if body.stream and params.raw("prompt_logprob_token_ids") is not None:
        raise Refused(bad_request("prompt_logprob_token_ids are not available when stream=true."))
    if params.stop:
        raise Refused(
            bad_request(
                "stop strings are not supported on a --tokens-only server because detokenization "
                "is disabled. Check stop strings on the coordinator, or use stop_token_ids."
            )
        )
    output_mode = body.output_mode if "output_mode" in body.model_fields_set else None
    if output_mode not in (None, "tokens"):
        raise Refused(
            bad_request(
                f"output_mode={output_mode!r} requires a tokenizer, but this server does not load one "
                "(--tokens-only or --skip-tokenizer-init). Send the request to a server that loads "
                "a tokenizer, or use output_mode='tokens'."
            )
        )
    check_msgpack([*params.integers(), body.kv_transfer_params])


# ------------------------------------------------------------------ engine


def engine_input_checks(
    params: SamplingChecks, token_ids: list[int], headers: Mapping[str, str], info: sidecar_pb2.ModelInfo
) -> int | None:
    """The engine's input checks that what the workers serve lets us make here, in vLLM's
    order: the sampling parameters (``SamplingParams.verify``: biased ids, stop ids, structured
    outputs), then the data-parallel rank, then the prompt's length, then its vocabulary.
    Returns the data-parallel rank asked for, or raises the first refusal.

    vLLM's engine checks one thing before all of these that no worker reports: a logprob count
    against its ``--max-logprobs`` (``SamplingParams._validate_logprobs``, first in
    ``verify``). So when a request asks for logprobs of a vLLM engine and these checks find a
    problem, only the engine knows which one vLLM names first. If every problem found is one
    the engine checks itself, in the same words, behind a vLLM sidecar that passes the request
    through (the ids' vocabulary, the prompt's length), the request is left to the engine,
    which answers in vLLM's order: the logprobs when over its maximum, else the same refusal
    (as vLLM answers it: a 400 unary, an error event in a stream). A problem the sidecar or
    this frontend would answer first in other words (structured outputs, which are not carried;
    the rank, which the sidecar checks) is refused here.
    """
    first: Refused | None = None
    engine_words = True  # every problem found is one the engine states the same way

    def found(refused: Refused, *, by_engine: bool) -> None:
        nonlocal first, engine_words
        first = first or refused
        engine_words = engine_words and by_engine

    try:
        params.check_vocabulary(info.vocab_size)
    except Refused as refused:
        found(refused, by_engine=True)
    if params.present("structured_outputs") and params.raw("structured_outputs") is not None:
        found(
            Refused(
                bad_request(
                    "Structured outputs requires a tokenizer so it can't be used with 'skip_tokenizer_init'"
                )
            ),
            by_engine=False,
        )
    rank: int | None = None
    try:
        rank = dp_rank(header(headers, "X-data-parallel-rank"), info.data_parallel_size)
    except Refused as refused:
        found(refused, by_engine=False)
    try:
        check_prompt(token_ids, info)
    except Refused as refused:
        found(refused, by_engine=True)
    if first is None:
        return rank
    if engine_words and _engine_checks_logprobs_first(params, info) and _carried(params, token_ids):
        return rank
    raise first


def _engine_checks_logprobs_first(params: SamplingChecks, info: sidecar_pb2.ModelInfo) -> bool:
    # vLLM checks a count only when it is non-zero (-1, the whole vocabulary, is refused by name
    # here: never carried); the vLLM sidecar carries counts within 32 signed bits.
    counts = (params.logprobs, params.prompt_logprobs)
    return info.engine == "vllm" and any(count is not None and 0 < count <= _INT32_MAX for count in counts)


def _carried(params: SamplingChecks, token_ids: list[int]) -> bool:
    # Every id the engine is to check must reach it: the sidecar's fields are 32-bit unsigned.
    ids = (*token_ids, *(params.logit_bias or {}), *(params.stop_token_ids or ()))
    return all(0 <= token <= UINT32_MAX for token in ids)


# ------------------------------------------------------------------ uncarried


def refuse_uncarried(body: GenerateRequest) -> None:
    """What this frontend cannot carry to a vLLM sidecar, refused by name."""
    if body.ec_transfer_params is not None:
        raise uncarried("ec_transfer_params", "encoder-cache transfer is not carried to the engine")
    if body.features is not None:
        raise uncarried("features", "multimodal features are not carried to the engine")
    if body.content_parts:
        raise uncarried("content_parts", "multimodal content is not carried to the engine")
    body.sampling_params.checked.refuse_uncarried()
