"""Pure conversion between the public API and vLLM's native gRPC wire (docs/vllm.md).

Two halves, both free of I/O, clocks, logging and globals:

* :func:`to_generate_request` turns a ``PreprocessedRequest`` into vLLM's ``GenerateRequest``
  or refuses it with INVALID_ARGUMENT naming the field. Nothing the wire cannot carry is
  dropped silently.
* :class:`ResponseState` is fed the engine's ``GenerateResponse`` messages one at a time and
  returns the ``LLMEngineOutput`` deltas the frontend sees.

The shapes it expects are those of vLLM's own servicer (``smg-grpc-servicer``,
``VllmEngineServicer.Generate``). Streaming (``stream`` true, vLLM's DELTA output kind): each
engine step yields one ``chunk`` per choice carrying that step's new tokens, and a finishing
step is followed by a ``complete`` for that choice whose ``output_ids`` restate the same final
delta. One answer (``stream`` false, vLLM's FINAL_ONLY): nothing until the request is over,
then one ``complete`` per choice carrying every token id, their logprobs, the prompt's
logprobs, the finish and the counts; a choice's terminal then carries all of it. Counts on
the wire are per message. The engine is asked for one answer when the caller wants one
(``OutputOptions.unary``, :func:`asks_one_answer`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

from google.protobuf import struct_pb2
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2

from sidecar_common import prompt_logprobs
from sidecar_common.api import sidecar_pb2
from sidecar_common.disaggregation import DisaggregationMode
from sidecar_common.errors import FailureReason, SidecarError, invalid_argument, protocol_error
from sidecar_common.limits import check_media, check_sampling_limits
from sidecar_common.logprob_floor import clamp_logprob
from sidecar_common.structs import JSON, json_from_struct, struct_from_json

__all__ = [
    "KNOWN_EXTRA_ARGS",
    "MAX_CHOICES",
    "ResponseState",
    "asks_one_answer",
    "to_generate_request",
    "wire_seed",
]

KNOWN_EXTRA_ARGS: Final = frozenset({"kv_transfer_params"})
# Choices per request; far beyond what any sampling use needs (OpenAI's API allows 128).
MAX_CHOICES: Final = 1024

_INT32_MIN: Final = -(2**31)
_INT32_MAX: Final = 2**31 - 1
_UINT32_MAX: Final = 2**32 - 1
_ENGINE: Final = "vllm"

_MEDIA_MODALITY: Final = {
    sidecar_pb2.MultimodalItem.IMAGE: common_pb2.IMAGE,
    sidecar_pb2.MultimodalItem.VIDEO: common_pb2.VIDEO,
}

_FINISH: Final = {
    "length": sidecar_pb2.LENGTH,
    "stop": sidecar_pb2.STOP,
    "abort": sidecar_pb2.CANCELLED,
}


# --------------------------------------------------------------------------- request


def to_generate_request(
    request: sidecar_pb2.PreprocessedRequest,
    private_id: str,
    *,
    mode: DisaggregationMode,
    supports_vision: bool,
    data_parallel_size: int = 0,
) -> vllm_engine_pb2.GenerateRequest:
    """The native request for one generation, or INVALID_ARGUMENT naming the field.

    ``data_parallel_size`` is the engine's, as discovered at start-up (0: not known, then a
    routed rank is not checked against it).
    """
    if not request.token_ids:
        raise invalid_argument("token_ids", "the prompt is empty")
    _refuse_uncarried(request, mode)
    check_sampling_limits(request, "vllm")
    native = vllm_engine_pb2.GenerateRequest(
        request_id=private_id,
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=request.token_ids),
        sampling_params=_sampling_params(request, mode),
        stream=not asks_one_answer(request, mode),
    )
    media = _media_refs(request.multi_modal_data, supports_vision)
    if media is not None:
        native.media_refs.CopyFrom(media)
    rank = _dp_rank(request.routing, mode, data_parallel_size)
    if rank is not None:
        native.data_parallel_rank = rank
    kv = _kv_transfer_params(request, mode)
    if kv is not None:
        native.kv_transfer_params_json = json.dumps(kv, separators=(",", ":"), allow_nan=False)
    return native


def asks_one_answer(request: sidecar_pb2.PreprocessedRequest, mode: DisaggregationMode) -> bool:
    """Whether the engine is asked for one answer (``stream`` false) rather than a stream: when
    the caller wants one (``OutputOptions.unary``) on an aggregated worker. A prefill streams
    as always (it sends only its handoff terminal either way), and so does a decode: the
    dispatcher holds a cancel until the decode's first token (its KV transfer), which one
    answer would show only at the end."""
    return request.output_options.unary and mode == "agg"


def _refuse_uncarried(request: sidecar_pb2.PreprocessedRequest, mode: DisaggregationMode) -> None:
    s = request.sampling_options
    if s.HasField("best_of") and s.best_of != 1:
        raise invalid_argument("sampling_options.best_of", "vLLM supports only best_of = 1")
    if s.HasField("use_beam_search") and s.use_beam_search:
        raise invalid_argument("sampling_options.use_beam_search", "beam search is not supported")
    if s.HasField("length_penalty") and s.length_penalty != 1.0:
        raise invalid_argument("sampling_options.length_penalty", "only applies to beam search")
    if request.output_options.token_ids_logprob:
        raise invalid_argument("output_options.token_ids_logprob", "the vLLM wire cannot carry it")
    out = request.output_options
    # vLLM's generate gRPC wire has no routed-experts field (smg-grpc-proto vllm_engine.proto);
    # a start of 0 is the default, and asks nothing.
    if out.HasField("return_routed_experts") and out.return_routed_experts:
        raise invalid_argument("output_options.return_routed_experts", "the vLLM wire cannot carry it")
    if out.HasField("routed_experts_start_len") and out.routed_experts_start_len != 0:
        raise invalid_argument("output_options.routed_experts_start_len", "the vLLM wire cannot carry it")
    r = request.routing
    # This version of vLLM's wire has no LoRA, priority or cache-salt field: refuse rather
    # than serve the request as if the hint had not been given.
    if r.HasField("lora_name") and r.lora_name:
        raise invalid_argument("routing.lora_name", "the vLLM wire cannot carry a LoRA adapter")
    if r.HasField("cache_namespace") and r.cache_namespace:
        raise invalid_argument("routing.cache_namespace", "the vLLM wire cannot carry a cache salt")
    if r.HasField("priority") and r.priority != 0:
        raise invalid_argument("routing.priority", "the vLLM wire cannot carry a priority")
    b = request.bootstrap_info
    if b.bootstrap_host or b.bootstrap_port or b.bootstrap_room:
        raise invalid_argument(
            "bootstrap_info", "SGLang rendezvous; vLLM hands off KV via disaggregated_params"
        )
    unknown = sorted(set(request.extra_args.fields) - KNOWN_EXTRA_ARGS)
    if unknown:
        raise invalid_argument(f"extra_args.{unknown[0]}", "unknown key (known: kv_transfer_params)")
    if mode != "decode" and request.HasField("prefill_result"):
        raise invalid_argument("prefill_result", f"only a decode sidecar takes a handoff (mode is {mode})")


def _sampling_params(
    request: sidecar_pb2.PreprocessedRequest, mode: DisaggregationMode
) -> vllm_engine_pb2.SamplingParams:
    s = request.sampling_options
    stop = request.stop_conditions
    out = request.output_options
    p = vllm_engine_pb2.SamplingParams(
        # The wire has no presence for these, so absent means vLLM's neutral value.
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        min_p=s.min_p if s.HasField("min_p") else 0.0,
        presence_penalty=s.presence_penalty if s.HasField("presence_penalty") else 0.0,
        frequency_penalty=s.frequency_penalty if s.HasField("frequency_penalty") else 0.0,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        top_k=_top_k(s),
        n=_n(s),
        min_tokens=stop.min_tokens if stop.HasField("min_tokens") else 0,
        stop=stop.stop,
        stop_token_ids=_stop_token_ids(stop),
        ignore_eos=stop.ignore_eos if stop.HasField("ignore_eos") else False,
        skip_special_tokens=out.skip_special_tokens if out.HasField("skip_special_tokens") else True,
        spaces_between_special_tokens=True,
        include_stop_str_in_output=(
            s.include_stop_str_in_output if s.HasField("include_stop_str_in_output") else False
        ),
    )
    if s.HasField("temperature"):
        p.temperature = s.temperature
    if s.HasField("seed"):
        p.seed = wire_seed(s.seed)
    if stop.HasField("max_tokens"):
        p.max_tokens = stop.max_tokens
    if out.HasField("logprobs"):
        p.logprobs = _int32("output_options.logprobs", out.logprobs)
    if out.HasField("prompt_logprobs"):
        p.prompt_logprobs = _int32("output_options.prompt_logprobs", out.prompt_logprobs)
    for token, bias in s.logit_bias.items():
        p.logit_bias[_int32("sampling_options.logit_bias", token)] = bias
    if s.HasField("guided_decoding"):
        _guided(s.guided_decoding, p)
    if mode == "prefill":
        # A prefill worker only fills the KV cache; the one token it samples is discarded.
        p.max_tokens = 1
        p.min_tokens = 1
    return p


def wire_seed(seed: int) -> int:
    """The engine's 32-bit seed for a seed of the public API.

    The wire carries an int32. Signed and unsigned 32-bit seeds are both common, so both are
    carried: a seed in [-2^31, 2^32 - 1] becomes the int32 with the same low 32 bits (2^31 and
    above wrap to seed - 2^32; the rest pass unchanged). A seed and the same bits read signed
    (s and s - 2^32) therefore give the same sample. A seed needing more than 32 bits is
    refused: no 32-bit field can carry its difference from every other seed.
    """
    if _INT32_MIN <= seed <= _INT32_MAX:
        return seed
    if _INT32_MAX < seed <= _UINT32_MAX:
        return seed - 2**32
    raise invalid_argument(
        "sampling_options.seed",
        f"{seed} needs more than the engine's 32 bits (a seed from {_INT32_MIN} to {_UINT32_MAX} is carried)",
    )


def _int32(name: str, value: int) -> int:
    if not _INT32_MIN <= value <= _INT32_MAX:
        raise invalid_argument(name, f"{value} does not fit the engine's 32-bit field")
    return value


def _top_k(s: sidecar_pb2.SamplingOptions) -> int:
    # The wire's 0 is "all"; the limits table has refused anything below -1.
    return max(s.top_k, 0) if s.HasField("top_k") else 0


def _n(s: sidecar_pb2.SamplingOptions) -> int:
    if not s.HasField("n"):
        return 1
    if s.n == 0:
        raise invalid_argument("sampling_options.n", "must be at least 1")
    if s.n > MAX_CHOICES:
        # Each choice costs the sidecar state per request; an unbounded uint32 would let one
        # request stall the event loop for every other stream.
        raise invalid_argument("sampling_options.n", f"at most {MAX_CHOICES} choices (got {s.n})")
    return s.n


def _stop_token_ids(stop: sidecar_pb2.StopConditions) -> list[int]:
    ids = set(stop.stop_token_ids)
    # With ignore_eos the engine would still stop on EOS through its stop-token check.
    if not (stop.HasField("ignore_eos") and stop.ignore_eos):
        ids.update(stop.stop_token_ids_hidden)
    return sorted(ids)


def _guided(g: sidecar_pb2.GuidedDecoding, p: vllm_engine_pb2.SamplingParams) -> None:
    if g.HasField("backend"):
        raise invalid_argument("sampling_options.guided_decoding.backend", "the vLLM wire cannot carry it")
    if g.HasField("whitespace_pattern"):
        raise invalid_argument(
            "sampling_options.guided_decoding.whitespace_pattern", "the vLLM wire cannot carry it"
        )
    kind = g.WhichOneof("kind")
    if kind == "json":
        try:
            schema = json.loads(g.json, parse_constant=_refuse_constant, parse_float=_finite_float)
        except (ValueError, RecursionError) as err:
            raise invalid_argument("sampling_options.guided_decoding.json", f"not JSON: {err}") from None
        p.json_schema = json.dumps(schema, separators=(",", ":"), allow_nan=False)
    elif kind == "regex":
        p.regex = g.regex
    elif kind == "grammar":
        p.grammar = g.grammar
    elif kind == "structural_tag":
        p.structural_tag = g.structural_tag
    elif kind == "choice":
        if not g.choice.choices:
            raise invalid_argument("sampling_options.guided_decoding.choice", "no choices given")
        p.choice.choices.extend(g.choice.choices)


def _media_refs(
    items: Sequence[sidecar_pb2.MultimodalItem], supports_vision: bool
) -> vllm_engine_pb2.MediaRefs | None:
    if not items:
        return None
    if not supports_vision:
        raise invalid_argument("multi_modal_data", "the served model does not support vision")
    check_media(items)
    refs = vllm_engine_pb2.MediaRefs()
    for i, item in enumerate(items):
        modality = _MEDIA_MODALITY.get(item.kind)
        if modality is None:
            kind = sidecar_pb2.MultimodalItem.Kind.Name(item.kind)
            raise invalid_argument(f"multi_modal_data[{i}].kind", f"{kind} is not supported by vLLM")
        refs.items.add(modality=modality, url=item.url)
    return refs


def _dp_rank(r: sidecar_pb2.RoutingHints, mode: DisaggregationMode, dp_size: int) -> int | None:
    if mode == "prefill" and r.HasField("prefill_dp_rank"):
        name, rank = "routing.prefill_dp_rank", r.prefill_dp_rank
    elif r.HasField("dp_rank"):
        name, rank = "routing.dp_rank", r.dp_rank
    else:
        return None
    # The engine would fail such a request with an opaque error; it is the caller's mistake.
    if dp_size > 0 and rank >= dp_size:
        raise invalid_argument(
            name, f"rank {rank} is out of range: the engine has data_parallel_size {dp_size}"
        )
    return _int32(name, rank)


def _kv_transfer_params(
    request: sidecar_pb2.PreprocessedRequest, mode: DisaggregationMode
) -> dict[str, JSON] | None:
    given = _extra_kv_params(request.extra_args)
    if mode == "agg":
        return given
    if mode == "prefill":
        return {**(given or {}), "do_remote_decode": True}
    if given is not None:
        raise invalid_argument(
            "extra_args.kv_transfer_params", "a decode request takes its handoff from prefill_result"
        )
    name = "prefill_result.disaggregated_params"
    if not request.prefill_result.HasField("disaggregated_params"):
        raise invalid_argument(name, "required on a decode request")
    try:
        params = json_from_struct(request.prefill_result.disaggregated_params)
    except ValueError as err:
        raise invalid_argument(name, str(err)) from None
    if "remote_port" in params:
        params["remote_port"] = _port_text(params["remote_port"])
    return params


def _extra_kv_params(extra: struct_pb2.Struct) -> dict[str, JSON] | None:
    if "kv_transfer_params" not in extra.fields:
        return None
    value = extra.fields["kv_transfer_params"]
    if value.WhichOneof("kind") != "struct_value":
        raise invalid_argument("extra_args.kv_transfer_params", "must be an object")
    try:
        return json_from_struct(value.struct_value)
    except ValueError as err:
        raise invalid_argument("extra_args.kv_transfer_params", str(err)) from None


def _port_text(port: JSON) -> JSON:
    # vLLM's connectors want the port as text; Struct turns every number into a double.
    if isinstance(port, bool) or not isinstance(port, int | float):
        return port
    if isinstance(port, float) and not port.is_integer():
        raise invalid_argument("prefill_result.disaggregated_params.remote_port", f"{port} is not a port")
    return str(int(port))


# -------------------------------------------------------------------------- response


@dataclass
class _Choice:
    # The ids forwarded so far: a `complete` that does not restate the last chunk must extend
    # them (compared by content, so kept, not only counted).
    streamed: list[int] = field(default_factory=list)
    # The token ids of this choice's latest chunk (the message's own repeated field, not a
    # copy): what a streaming `complete` restates.
    last_chunk: Sequence[int] | None = None
    done: bool = False


class ResponseState:
    """One request's engine stream, fed a message at a time (see the module docstring).

    ``feed`` returns the deltas to forward (possibly none) or raises SidecarError:
    PROTOCOL_ERROR for malformed engine data, UNKNOWN when the engine reports an error
    finish. Messages for a choice after its terminal are ignored.
    """

    def __init__(self, request: sidecar_pb2.PreprocessedRequest, mode: DisaggregationMode) -> None:
        # Absent n reads 0 here: one choice (the request converter refused an explicit 0).
        n = request.sampling_options.n or 1
        self._choices = [_Choice() for _ in range(n)]
        self._open = n  # choices still without their terminal (checked after every message)
        self._mode = mode
        self._user_stops = frozenset(request.stop_conditions.stop_token_ids)
        out = request.output_options
        self._logprobs: int | None = out.logprobs if out.HasField("logprobs") else None
        self._want_prompt_logprobs = out.HasField("prompt_logprobs")
        self._prompt_logprobs: list[sidecar_pb2.TopLogprobs] | None = None
        self._prompt_tokens = len(request.token_ids)
        self._cached_tokens = 0

    @property
    def finished(self) -> bool:
        """Every choice has had its terminal."""
        return self._open == 0

    def feed(self, response: vllm_engine_pb2.GenerateResponse) -> list[sidecar_pb2.LLMEngineOutput]:
        kind = response.WhichOneof("response")
        if kind == "chunk":
            return self._chunk(response.chunk)
        if kind == "complete":
            return self._complete(response.complete)
        raise protocol_error(_ENGINE, "a Generate message with neither chunk nor complete")

    def _choice(self, index: int) -> _Choice:
        if index >= len(self._choices):
            raise protocol_error(_ENGINE, f"choice index {index} but n = {len(self._choices)}")
        return self._choices[index]

    def _observe_counts(self, prompt_tokens: int, cached_tokens: int) -> None:
        if prompt_tokens:
            self._prompt_tokens = prompt_tokens
        if cached_tokens:
            self._cached_tokens = cached_tokens

    def _observe_prompt_logprobs(
        self, msg: vllm_engine_pb2.GenerateStreamChunk | vllm_engine_pb2.GenerateComplete
    ) -> None:
        if self._want_prompt_logprobs and self._prompt_logprobs is None and msg.HasField("input_logprobs"):
            self._prompt_logprobs = _prompt_positions(msg.input_logprobs)

    def _chunk(self, chunk: vllm_engine_pb2.GenerateStreamChunk) -> list[sidecar_pb2.LLMEngineOutput]:
        # The hot path (one call per engine message): each field is read once.
        index = chunk.index
        choice = self._choice(index)
        if choice.done:
            return []
        # The message's repeated field, read in place: copied once, into the output.
        ids = chunk.token_ids
        _check_count("chunk", chunk.completion_tokens, ids)
        prompt_tokens = chunk.prompt_tokens
        cached_tokens = chunk.cached_tokens
        if prompt_tokens or cached_tokens:
            self._observe_counts(prompt_tokens, cached_tokens)
        if self._want_prompt_logprobs:
            self._observe_prompt_logprobs(chunk)
        choice.last_chunk = ids
        if not ids or self._mode == "prefill":
            # A prefill hands off KV only; the token it samples belongs to the decode side.
            return []
        out = sidecar_pb2.LLMEngineOutput(token_ids=ids, index=index)
        if self._logprobs is not None:
            self._attach_logprobs(out, chunk.output_logprobs, ids, 0)
        choice.streamed.extend(ids)
        return [out]

    def _complete(self, done: vllm_engine_pb2.GenerateComplete) -> list[sidecar_pb2.LLMEngineOutput]:
        choice = self._choice(done.index)
        if choice.done:
            return []
        reason = done.finish_reason
        if reason == "error":
            raise SidecarError(
                FailureReason.UNKNOWN,
                f"Generate: engine reported an error (finish_reason=error, choice {done.index})",
            )
        finish = _FINISH.get(reason)
        if finish is None:
            raise protocol_error(_ENGINE, f"unknown finish reason {reason!r}")
        _check_count("complete", done.completion_tokens, done.output_ids)
        self._observe_counts(done.prompt_tokens, done.cached_tokens)
        self._observe_prompt_logprobs(done)
        out = sidecar_pb2.LLMEngineOutput(index=done.index, finish_reason=finish)
        if self._mode == "prefill":
            if finish != sidecar_pb2.CANCELLED:
                out.disaggregated_params.CopyFrom(_handoff(done))
        else:
            ids = list(done.output_ids)
            offset = self._new_offset(choice, ids, done.index)
            if offset < len(ids):
                out.token_ids.extend(ids[offset:])
                self._attach_logprobs(out, done.output_logprobs, ids, offset)
                choice.streamed.extend(ids[offset:])
            if finish == sidecar_pb2.STOP:
                self._stop_reason(out, done, choice.streamed)
        choice.done = True
        self._open -= 1
        completion = len(choice.streamed)  # a prefill streams nothing: 0
        out.completion_usage.prompt_tokens = self._prompt_tokens
        out.completion_usage.completion_tokens = completion
        out.completion_usage.total_tokens = self._prompt_tokens + completion
        out.completion_usage.cached_tokens = self._cached_tokens
        if self._prompt_logprobs is not None:
            prompt_logprobs.attach(out, self._prompt_logprobs, prompt_logprobs.Shape.BY_TOKEN)
        return [out]

    @staticmethod
    def _new_offset(choice: _Choice, ids: list[int], index: int) -> int:
        """How many of ``complete.output_ids`` were already forwarded for this choice.

        A complete right after a chunk with the same ids restates that final delta (the
        servicer's streaming shape): nothing is new. Otherwise the ids must extend what was
        streamed (the non-streaming shape carries every token): the tail is new.
        """
        if not ids or ids == choice.last_chunk:
            return len(ids)
        streamed = choice.streamed
        if ids[: len(streamed)] == streamed:
            return len(streamed)
        raise protocol_error(
            _ENGINE,
            f"complete.output_ids of choice {index} neither restate the last chunk nor extend "
            f"the {len(streamed)} tokens streamed",
        )

    def _stop_reason(
        self, out: sidecar_pb2.LLMEngineOutput, done: vllm_engine_pb2.GenerateComplete, streamed: list[int]
    ) -> None:
        matched = done.WhichOneof("matched_stop")
        if matched == "matched_stop_str":
            out.stop_string = done.matched_stop_str
        elif matched == "matched_token_id" and done.matched_token_id in self._user_stops:
            out.stop_token_id = done.matched_token_id
        elif matched is None and streamed and streamed[-1] in self._user_stops:
            # vLLM checks EOS before the stop ids and reports no match for it; the caller who
            # listed that token among its stops hears it named, as for any stop id it listed.
            out.stop_token_id = streamed[-1]

    def _attach_logprobs(
        self,
        out: sidecar_pb2.LLMEngineOutput,
        lp: vllm_engine_pb2.OutputLogProbs,
        ids: Sequence[int],
        offset: int,
    ) -> None:
        if self._logprobs is None:
            return
        # ids is never empty here, so an absent output_logprobs (read as empty) fails alignment.
        if lp.token_ids != ids or len(lp.token_logprobs) != len(ids):
            raise protocol_error(_ENGINE, "output logprobs are not aligned with the token ids")
        tops = lp.top_logprobs
        if len(tops) not in (0, len(ids)):
            raise protocol_error(_ENGINE, "top logprobs are not aligned with the token ids")
        for i in range(offset, len(ids)):
            sampled, raw = ids[i], lp.token_logprobs[i]
            value = clamp_logprob(raw)
            out.log_probs.append(value)
            entries = out.top_logprobs.add().entries
            sampled_entry = entries.add(token_id=sampled, logprob=value)
            if tops and self._logprobs > 0:
                ranked = _ranked(raw, sampled, _pairs(tops[i], "top logprobs"))
                if ranked.own_rank is not None:
                    sampled_entry.rank = ranked.own_rank
                for token, alt, rank in ranked.alternatives:
                    entries.add(token_id=token, logprob=clamp_logprob(alt), rank=rank)


def _check_count(what: str, count: int, ids: Sequence[int]) -> None:
    # The servicer's counts are per message; a mismatch means a different (or broken) wire.
    if count != len(ids):
        raise protocol_error(_ENGINE, f"{what} says completion_tokens {count} but carries {len(ids)} ids")


def _pairs(top: vllm_engine_pb2.TopLogProbs, what: str) -> Iterable[tuple[int, float]]:
    if len(top.token_ids) != len(top.values):
        raise protocol_error(_ENGINE, f"{what}: {len(top.token_ids)} ids but {len(top.values)} values")
    return zip(top.token_ids, top.values, strict=True)


@dataclass(frozen=True)
class _Ranked:
    own_rank: int | None
    alternatives: list[tuple[int, float, int]]  # token, logprob, rank


def _ranked(own_value: float, own: int, top: Iterable[tuple[int, float]]) -> _Ranked:
    """Ranks for one position's top list, which the wire sends without them.

    vLLM's servicer sends the first k entries of vLLM's per-position dict: the position's own
    token (sampled, or the prompt's) with its rank, then the top k in rank order without it.
    So the alternatives are the top k in order, the own token's place left out: those whose
    logprob is at least the own token's come before it. The own token's rank (vLLM counts the
    tokens at least as likely, itself included) is known when an alternative is less likely
    than it: then it is inside the top k and every token before it is on the wire. Otherwise
    (no alternative below it) it may be the k-th or outside the top k: unknown.
    """
    alternatives = [(token, value) for token, value in top if token != own]
    if math.isnan(own_value):
        above = len(alternatives)  # no place (vLLM's rank 0): every alternative comes first
    else:
        above = sum(1 for _, value in alternatives if value >= own_value)
    own_rank = above + 1 if above < len(alternatives) else None
    return _Ranked(
        own_rank,
        [
            (token, value, place if place <= above else place + 1)
            for place, (token, value) in enumerate(alternatives, 1)
        ],
    )


def _prompt_positions(lp: vllm_engine_pb2.InputLogProbs) -> list[sidecar_pb2.TopLogprobs]:
    """Per prompt position: none where the engine has no logprob, else the prompt token (its
    rank where known), then each other alternative once, in rank order."""
    if len(lp.token_logprobs) != len(lp.token_ids) or len(lp.top_logprobs) not in (0, len(lp.token_ids)):
        raise protocol_error(_ENGINE, "prompt logprobs are not aligned with the prompt tokens")
    result: list[sidecar_pb2.TopLogprobs] = []
    for i, token in enumerate(lp.token_ids):
        entry = lp.token_logprobs[i]
        position = sidecar_pb2.TopLogprobs()
        result.append(position)
        if not entry.HasField("value"):
            continue
        if not lp.top_logprobs:
            position.entries.append(prompt_logprobs.candidate(token, clamp_logprob(entry.value)))
            continue
        ranked = _ranked(entry.value, token, _pairs(lp.top_logprobs[i], "prompt top logprobs"))
        position.entries.append(prompt_logprobs.candidate(token, clamp_logprob(entry.value), ranked.own_rank))
        seen = {token}
        for alt, value, rank in ranked.alternatives:
            if alt not in seen:
                seen.add(alt)
                position.entries.append(prompt_logprobs.candidate(alt, clamp_logprob(value), rank))
    return result


def _handoff(done: vllm_engine_pb2.GenerateComplete) -> struct_pb2.Struct:
    if not done.HasField("kv_transfer_params_json"):
        raise protocol_error(_ENGINE, "a successful prefill without kv_transfer_params_json")
    try:
        params = json.loads(done.kv_transfer_params_json, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as err:
        raise protocol_error(_ENGINE, f"kv_transfer_params_json is not JSON: {err}") from None
    if not isinstance(params, dict):
        raise protocol_error(_ENGINE, "kv_transfer_params_json is not an object")
    return _to_struct(params)


def _refuse_constant(name: str) -> JSON:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    # 1e999 is valid JSON that Python reads as infinity, which strict JSON cannot carry on.
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text} is out of range")
    return value


def _to_struct(value: dict[str, JSON]) -> struct_pb2.Struct:
    try:
        return struct_from_json(value)
    except (ValueError, RecursionError) as err:
        raise protocol_error(_ENGINE, f"cannot carry as a Struct: {err}") from None
