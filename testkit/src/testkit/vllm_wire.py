"""vLLM's gRPC messages as the testkit engine sends them (pure: no I/O, no clock, no asyncio).

Builds what ``vllm_engine`` sends, following smg-grpc-servicer's ``VllmEngineServicer``: with
``stream=true`` (vLLM's DELTA output kind) the per-step ``chunk`` of one choice and the
``complete`` that restates a choice's final delta; with ``stream=false`` (FINAL_ONLY) nothing
until every choice is done, then one ``complete`` per choice carrying all of it
(:func:`step`). Also vLLM's final abort output (either mode), the logprob shapes (the chosen
token first, then the top-k without it), the NIXL-shaped prefill handoff, and the malformed
terminals a fault asks for.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from testkit.generator import Finish, GeneratedToken, Generator, PositionLogprobs, SamplingSpec

__all__ = [
    "HANDOFF_FIELDS",
    "NEGATIVE_ONE_AS_UINT32",
    "Choice",
    "chunk",
    "complete",
    "from_abort",
    "handoff",
    "input_logprobs",
    "malform",
    "output_logprobs",
    "prompt_refusal",
    "sampling_refusal",
    "sampling_spec",
    "step",
    "stopped",
]

# What a decode request's kv params must name (vLLM's NIXL connector reads each).
HANDOFF_FIELDS = ("remote_host", "remote_port", "remote_engine_id", "remote_block_ids")
NEGATIVE_ONE_AS_UINT32 = 0xFFFFFFFF  # the wire's ids are uint32: -1 can only arrive like this


class Choice:
    """One choice's generator plus what the wire needs to remember about it."""

    def __init__(self, gen: Generator) -> None:
        self.gen = gen
        self.all_ids: list[int] = []
        self.all_lps: list[PositionLogprobs | None] = []
        self.first_sent = False
        self.finish: Finish | None = None
        # Where each weight version's tokens start (testkit.weight_versions.vllm_track).
        self.version_starts: tuple[tuple[str, int], ...] = ()


def _validation_error(message: str, parameter: str | None = None, value: object = None) -> str:
    """The text of vLLM's ``VLLMValidationError``: the message, then what it names."""
    extras = []
    if parameter is not None:
        extras.append(f"parameter={parameter}")
    if value is not None:
        extras.append(f"value={value}")
    return f"{message} ({', '.join(extras)})" if extras else message


def sampling_refusal(sp: pb.SamplingParams, vocab_size: int, max_logprobs: int) -> str | None:
    """What vLLM says of a request's sampling parameters, in its order: ``SamplingParams``'
    own checks, then ``verify`` (logprobs, prompt logprobs, logit_bias, stop_token_ids).
    None: nothing to say."""
    if sp.HasField("max_tokens") and sp.max_tokens < 1:
        return _validation_error(
            f"max_tokens must be at least 1, got {sp.max_tokens}.", "max_tokens", sp.max_tokens
        )
    limits = (("logprobs", "sample"), ("prompt_logprobs", "prompt"))
    for name, kind in limits:
        if sp.HasField(name):
            asked = getattr(sp, name)
            asked = vocab_size if asked == -1 else asked
            if asked > max_logprobs:
                return _validation_error(
                    f"Requested {kind} logprobs of {asked}, "
                    f"which is greater than max allowed: {max_logprobs}",
                    name,
                    asked,
                )
    for name, ids in (("logit_bias", list(sp.logit_bias)), ("stop_token_ids", list(sp.stop_token_ids))):
        invalid = sorted(t for t in ids if t < 0 or t >= vocab_size)
        if invalid:
            return _validation_error(
                f"token_id(s) {invalid} in {name} contain out-of-vocab token ids. "
                f"Vocabulary size: {vocab_size}",
                name,
                invalid,
            )
    return None


def prompt_refusal(prompt: tuple[int, ...], vocab_size: int, context_length: int) -> str | None:
    """What vLLM says of a prompt, in its order: empty, too long, outside the vocabulary."""
    if not prompt:
        return "The decoder prompt cannot be empty"
    length = len(prompt)
    if length > context_length:
        return (
            f"The decoder prompt (length {length}) is longer than the maximum model length of "
            f"{context_length}. Make sure that `max_model_len` is no smaller than the number of "
            "text tokens."
        )
    if length == context_length:
        return (
            f"The decoder prompt (length {length}) plus the number of requested output tokens "
            f"(at least 1) is longer than the maximum model length of {context_length}. Make sure "
            "that `max_model_len` is no smaller than the number of text tokens (prompt + requested "
            "output tokens)."
        )
    if max(prompt) >= vocab_size:
        return f"Token id {max(prompt)} is out of vocabulary"
    return None


def sampling_spec(request: pb.GenerateRequest) -> SamplingSpec:
    """The generator's view of a request's sampling parameters."""
    sp = request.sampling_params
    return SamplingSpec(
        max_tokens=sp.max_tokens if sp.HasField("max_tokens") else None,
        min_tokens=sp.min_tokens,
        stop_token_ids=tuple(sp.stop_token_ids),
        stop=tuple(sp.stop),
        ignore_eos=sp.ignore_eos,
        include_stop_str_in_output=sp.include_stop_str_in_output,
        seed=sp.seed if sp.HasField("seed") else None,
        n=sp.n if sp.n > 0 else 1,
        logprobs=sp.logprobs if sp.HasField("logprobs") else None,
        prompt_logprobs=sp.prompt_logprobs if sp.HasField("prompt_logprobs") else None,
    )


def _top(lp: PositionLogprobs | None, num: int) -> pb.TopLogProbs:
    # vLLM's per-position dict holds the chosen token first, then the top-k without it.
    top = pb.TopLogProbs()
    if lp is None or num <= 0:
        return top
    entries = [(lp.token_id, lp.logprob), *((t, v) for t, v in lp.top if t != lp.token_id)]
    for tid, value in entries[:num]:
        top.token_ids.append(tid)
        top.values.append(value)
    return top


def output_logprobs(lps: list[PositionLogprobs | None], num: int | None) -> pb.OutputLogProbs | None:
    if num is None or not lps:
        return None
    out = pb.OutputLogProbs()
    for lp in lps:
        assert lp is not None
        out.token_logprobs.append(lp.logprob)
        out.token_ids.append(lp.token_id)
        if num:
            out.top_logprobs.append(_top(lp, num))
    return out


def input_logprobs(
    prompt: tuple[int, ...], plp: list[PositionLogprobs | None] | None, num: int | None
) -> pb.InputLogProbs | None:
    if plp is None or num is None:
        return None
    out = pb.InputLogProbs()
    for tok, lp in zip(prompt, plp, strict=True):
        entry = pb.InputTokenLogProb()
        if lp is not None:
            entry.value = lp.logprob
        out.token_logprobs.append(entry)
        out.token_ids.append(tok)
        if num:
            out.top_logprobs.append(_top(lp, num))
    return out


def chunk(
    ch: Choice,
    ids: list[int],
    lps: list[PositionLogprobs | None],
    prompt_tokens: int,
    cached: int,
    in_lp: pb.InputLogProbs | None,
    logprobs: int | None,
) -> pb.GenerateResponse:
    """One step's delta for one choice; counts are per message, input logprobs only first."""
    message = pb.GenerateResponse(
        chunk=pb.GenerateStreamChunk(
            token_ids=ids,
            prompt_tokens=prompt_tokens,
            completion_tokens=len(ids),
            cached_tokens=cached,
            output_logprobs=output_logprobs(lps, logprobs),
            input_logprobs=None if ch.first_sent else in_lp,
            index=ch.gen.index,
        )
    )
    ch.first_sent = True
    return message


def _last_chunk_start(ch: Choice, chunk_tokens: int) -> int:
    # Every chunk but the last is full, so the last one starts at the last full multiple.
    n = len(ch.all_ids)
    return ((n - 1) // chunk_tokens) * chunk_tokens if n else 0


def complete(
    ch: Choice,
    fin: Finish,
    *,
    stream: bool,
    chunk_tokens: int,
    primary_eos: int,
    prompt_tokens: int,
    cached: int,
    in_lp: pb.InputLogProbs | None,
    sampling: SamplingSpec,
    handoff: dict[str, Any] | None,
) -> pb.GenerateResponse:
    """A choice's terminal. Streaming restates the final delta (the last chunk's ids),
    otherwise all the ids. A primary-EOS stop names no ``matched_stop`` (vLLM's scheduler sets
    no stop_reason for it); other stop tokens and EOS ids report ``matched_token_id``."""
    n_last = len(ch.all_ids) - _last_chunk_start(ch, chunk_tokens) if stream else len(ch.all_ids)
    ids, lps = ch.all_ids[-n_last:] if n_last else [], ch.all_lps[-n_last:] if n_last else []
    done = pb.GenerateComplete(
        output_ids=ids,
        finish_reason=fin.reason,
        prompt_tokens=prompt_tokens,
        completion_tokens=len(ids),
        cached_tokens=cached,
        output_logprobs=output_logprobs(lps, sampling.logprobs),
        input_logprobs=in_lp,
        index=ch.gen.index,
    )
    is_primary_eos = fin.is_eos and not sampling.ignore_eos and fin.matched_token_id == primary_eos
    if fin.matched_stop_str is not None:
        done.matched_stop_str = fin.matched_stop_str
    elif fin.matched_token_id is not None and not is_primary_eos:
        done.matched_token_id = fin.matched_token_id
    if handoff is not None:
        done.kv_transfer_params_json = json.dumps(handoff)
        done.kv_transfer_params.remote_host = str(handoff["remote_host"])
        done.kv_transfer_params.remote_port = int(handoff["remote_port"])
    return pb.GenerateResponse(complete=done)


def from_abort(
    ch: Choice,
    prompt_tokens: int,
    cached: int,
    *,
    stream: bool = True,
    in_lp: pb.InputLogProbs | None = None,
    logprobs: int | None = None,
) -> list[pb.GenerateResponse]:
    """vLLM's final abort output for one choice. Streaming: an empty chunk, then
    complete("abort"). One answer (FINAL_ONLY, whose outputs are whole): complete("abort")
    alone, carrying every token so far with its logprobs, and the prompt's logprobs once a
    step ran (a stream sends them with its first chunk)."""
    i = ch.gen.index
    if not stream:
        return [
            pb.GenerateResponse(
                complete=pb.GenerateComplete(
                    output_ids=ch.all_ids,
                    finish_reason="abort",
                    prompt_tokens=prompt_tokens,
                    completion_tokens=len(ch.all_ids),
                    cached_tokens=cached,
                    output_logprobs=output_logprobs(ch.all_lps, logprobs),
                    input_logprobs=in_lp if ch.all_ids else None,
                    index=i,
                )
            )
        ]
    return [
        pb.GenerateResponse(
            chunk=pb.GenerateStreamChunk(prompt_tokens=prompt_tokens, cached_tokens=cached, index=i)
        ),
        pb.GenerateResponse(
            complete=pb.GenerateComplete(
                finish_reason="abort", prompt_tokens=prompt_tokens, cached_tokens=cached, index=i
            )
        ),
    ]


def step(
    choices: Sequence[Choice],
    *,
    stream: bool,
    chunk_tokens: int,
    primary_eos: int,
    prompt_tokens: int,
    cached: int,
    in_lp: pb.InputLogProbs | None,
    sampling: SamplingSpec,
    handoff: Callable[[], dict[str, Any] | None],
) -> tuple[list[pb.GenerateResponse], int]:
    """One engine step: every unfinished choice generates up to ``chunk_tokens`` tokens. The
    messages the servicer sends for the step, and how many tokens it produced. Streaming: a
    chunk per choice, and a choice that finished adds its complete. One answer: nothing until
    every choice is done, then one complete per choice. ``handoff`` makes a finishing choice's
    handoff (a prefill's; None otherwise)."""
    messages: list[pb.GenerateResponse] = []
    produced = 0
    for ch in [ch for ch in choices if not ch.gen.done]:
        toks: list[GeneratedToken] = []
        while len(toks) < chunk_tokens and not ch.gen.done:
            toks.append(ch.gen.step())
        ids = [t.token_id for t in toks]
        lps = [t.logprobs for t in toks]
        ch.all_ids += ids
        ch.all_lps += lps
        produced += len(ids)
        fin = ch.finish = toks[-1].finish
        if stream:
            messages.append(chunk(ch, ids, lps, prompt_tokens, cached, in_lp, sampling.logprobs))
        if fin is not None and (stream or all(x.gen.done for x in choices)):
            for done in [ch] if stream else choices:
                messages.append(
                    complete(
                        done,
                        done.finish or fin,
                        stream=stream,
                        chunk_tokens=chunk_tokens,
                        primary_eos=primary_eos,
                        prompt_tokens=prompt_tokens,
                        cached=cached,
                        in_lp=in_lp,
                        sampling=sampling,
                        handoff=handoff(),
                    )
                )
    return messages, produced


def stopped(
    choices: Sequence[Choice],
    *,
    stream: bool,
    chunk_tokens: int,
    primary_eos: int,
    prompt_tokens: int,
    cached: int,
    in_lp: pb.InputLogProbs | None,
    sampling: SamplingSpec,
) -> list[pb.GenerateResponse]:
    """The last messages of a request aborted while it ran: each unfinished choice's abort
    output (:func:`from_abort`). One answer (FINAL_ONLY) holds every choice until the request
    is over, so the choices that had finished come now too, in choice order, each with its own
    finish."""
    messages: list[pb.GenerateResponse] = []
    for ch in choices:
        if not ch.gen.done:
            messages += from_abort(
                ch, prompt_tokens, cached, stream=stream, in_lp=in_lp, logprobs=sampling.logprobs
            )
        elif not stream and ch.finish is not None:
            messages.append(
                complete(
                    ch,
                    ch.finish,
                    stream=False,
                    chunk_tokens=chunk_tokens,
                    primary_eos=primary_eos,
                    prompt_tokens=prompt_tokens,
                    cached=cached,
                    in_lp=in_lp,
                    sampling=sampling,
                    handoff=None,
                )
            )
    return messages


def handoff(
    prompt_tokens: int, block_size: int, first_block: int, engine_id: str, host: str, port: int
) -> dict[str, Any]:
    """A prefill's NIXL-shaped kv_transfer_params: the blocks holding the prompt's KV."""
    nblocks = -(-prompt_tokens // block_size)
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": list(range(first_block, first_block + nblocks)),
        "remote_engine_id": engine_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
    }


def malform(msg: pb.GenerateResponse, variant: str) -> pb.GenerateResponse:
    """A copy of a ``complete`` bent the way a malformed-terminal fault asks."""
    bad = pb.GenerateResponse()
    bad.CopyFrom(msg)
    done = bad.complete
    if variant == "missing_finish_reason":
        done.finish_reason = ""
    elif variant == "unknown_finish_reason":
        done.finish_reason = "exploded"
    elif variant == "count_mismatch":
        done.completion_tokens = len(done.output_ids) + 7
    elif variant == "negative_id":
        done.output_ids.append(NEGATIVE_ONE_AS_UINT32)
    return bad
