"""Continuing a generation on another worker after its worker failed (pure).

When a sidecar ends a stream with a ``migratable`` error (CANNOT_CONNECT, ENGINE_SHUTDOWN, a
CONNECTION_TIMEOUT so marked) the frontend can run the rest of the request elsewhere: the new
prompt is the original prompt followed by every token already delivered, and the token budgets
shrink by what was delivered. The client must see one uninterrupted stream, so the outputs of the
continuation are rewritten as if they came from the first worker: usage counts the original prompt
and the whole completion, prompt logprobs cover the original prompt only, the cumulative logprob
goes on from where it stopped, and the terminal's ``weight_versions`` cover the whole output: the
tokens delivered before by their outputs' labels, the last leg's by its own spans shifted after
them (``weight_spans``; none when any delivered output had no label), its ``weight_version`` the
last span's. Routed experts need no joining: an attempt returns them on its terminal only, so a
continued attempt delivered none, and the continuation keeps the original
``routed_experts_start_len``: its prompt holds every token delivered, so its rows cover the
original start to the end of the whole output, exactly what one attempt would have answered.
A generation that never moved is given exactly what its worker sent.

:class:`Migration` is the whole state of one sub-request across its attempts, fed every output the
client was given (``delivered``) and asked, when an attempt fails, what to run next
(``after_failure``). No I/O, no clock: the handler owns those.

What is never migrated, and why:

* guided decoding: the grammar's state after the delivered tokens cannot be rebuilt from a prompt;
* ``n > 1``: the choices share one engine request, and their streams cannot be resumed one by one;
* a request whose every terminal was delivered: it finished, and must never run twice;
* a failure the sidecar did not mark migratable (a bad request fails the same way everywhere);
* more attempts than the migration limit (a request that kills workers must not kill the fleet).

A generation the frontend itself stopped (admission preempted it for a more urgent request,
``admission/``) continues the same way (:meth:`Migration.after_preemption`), but no worker
failed: the migration limit is not charged. Only a request :func:`resume_refusal` has nothing
against is preempted at all.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from sidecar_common import prompt_logprobs
from sidecar_common.api import sidecar_pb2
from sidecar_frontend.weight_spans import Span, SpanJoiner, spans_of

__all__ = ["DEFAULT_MIGRATION_LIMIT", "Finish", "Migration", "Refusal", "RefusalReason", "resume_refusal"]

DEFAULT_MIGRATION_LIMIT = 3


class RefusalReason(enum.Enum):
    NOT_MIGRATABLE = "the worker's error is not migratable"
    GUIDED_DECODING = "guided decoding cannot resume from a prompt"
    MULTIPLE_CHOICES = "n > 1 cannot resume choice by choice"
    FINISHED = "every terminal was delivered"
    LIMIT = "the migration limit was reached"


@dataclass(frozen=True)
class Refusal:
    reason: RefusalReason


@dataclass(frozen=True)
class Finish:
    """Nothing is left to generate: the failure came after the last token of the budget but
    before its terminal. ``terminal`` is the chunk to give the client (finish LENGTH, usage)."""

    terminal: sidecar_pb2.LLMEngineOutput


def resume_refusal(request: sidecar_pb2.PreprocessedRequest) -> RefusalReason | None:
    """Why a generation of ``request`` could never continue from its delivered tokens, whatever
    failed (guided decoding, ``n > 1``); None when it can."""
    if request.sampling_options.HasField("guided_decoding"):
        return RefusalReason.GUIDED_DECODING
    if request.sampling_options.n > 1:
        return RefusalReason.MULTIPLE_CHOICES
    return None


class Migration:
    """One sub-request across its attempts (the first one included)."""

    def __init__(
        self, request: sidecar_pb2.PreprocessedRequest, limit: int = DEFAULT_MIGRATION_LIMIT
    ) -> None:
        self._original = request
        self._limit = limit
        self._migrations = 0
        # Continuations so far, migrations and preemptions (outputs are rewritten after one).
        self._continuations = 0
        self._delivered: list[int] = []
        self._finished = False
        # Where the current attempt's accounting starts.
        self._base_tokens = 0
        self._base_cum_logprob = 0.0
        self._last_cum_logprob: float | None = None
        # Which weights made the delivered tokens, and those before the current attempt.
        self._spans = SpanJoiner()
        self._spans_before: tuple[Span, ...] = ()

    @property
    def migrations(self) -> int:
        """How many times the request moved to another worker so far."""
        return self._migrations

    @property
    def delivered_tokens(self) -> tuple[int, ...]:
        return tuple(self._delivered)

    @property
    def finished(self) -> bool:
        return self._finished

    def delivered(self, output: sidecar_pb2.LLMEngineOutput) -> sidecar_pb2.LLMEngineOutput:
        """Record an output of the current attempt; return it as the client must see it."""
        out = output
        if self._continuations:
            out = self._rewrite(output)
        self._delivered.extend(out.token_ids)
        self._spans.add(out)
        if out.HasField("cum_log_probs"):
            self._last_cum_logprob = out.cum_log_probs
        if out.finish_reason != sidecar_pb2.UNSPECIFIED:
            self._finished = True
        return out

    def after_failure(self, migratable: bool) -> sidecar_pb2.PreprocessedRequest | Refusal | Finish:
        """The current attempt failed: the request to run next, or why there is none."""
        if self._finished:
            return Refusal(RefusalReason.FINISHED)
        if not migratable:
            return Refusal(RefusalReason.NOT_MIGRATABLE)
        refused = resume_refusal(self._original)
        if refused is not None:
            return Refusal(refused)
        if self._migrations >= self._limit:
            return Refusal(RefusalReason.LIMIT)
        following = self._continuation()
        if isinstance(following, sidecar_pb2.PreprocessedRequest):
            self._migrations += 1
        return following

    def after_preemption(self) -> sidecar_pb2.PreprocessedRequest | Refusal | Finish:
        """The current attempt was stopped by the frontend (preempted): the continuation, as
        after a migratable failure, not counted against the migration limit."""
        if self._finished:
            return Refusal(RefusalReason.FINISHED)
        refused = resume_refusal(self._original)
        if refused is not None:
            return Refusal(refused)
        return self._continuation()

    def _continuation(self) -> sidecar_pb2.PreprocessedRequest | Finish:
        """The request that generates the rest from the delivered tokens, or the LENGTH
        terminal when the budget was spent."""
        original = self._original
        stop = original.stop_conditions
        done = len(self._delivered)
        if stop.HasField("max_tokens") and done >= stop.max_tokens:
            self._finished = True
            return Finish(self._length_terminal())
        nxt = sidecar_pb2.PreprocessedRequest()
        nxt.CopyFrom(original)
        nxt.token_ids.extend(self._delivered)
        if stop.HasField("max_tokens"):
            nxt.stop_conditions.max_tokens = stop.max_tokens - done
        if stop.HasField("min_tokens"):
            nxt.stop_conditions.min_tokens = max(0, stop.min_tokens - done)
        # A handoff belongs to the attempt it was made for; the next attempt gets its own.
        nxt.ClearField("prefill_result")
        nxt.ClearField("bootstrap_info")
        self._continuations += 1
        self._base_tokens = done
        self._spans_before = tuple(self._spans.labels())
        self._base_cum_logprob = self._last_cum_logprob or 0.0
        return nxt

    def _rewrite(self, output: sidecar_pb2.LLMEngineOutput) -> sidecar_pb2.LLMEngineOutput:
        out = sidecar_pb2.LLMEngineOutput()
        out.CopyFrom(output)
        prompt = len(self._original.token_ids)
        if out.HasField("completion_usage"):
            usage = out.completion_usage
            usage.prompt_tokens = prompt
            usage.completion_tokens += self._base_tokens
            usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
            if usage.HasField("cached_tokens"):
                usage.cached_tokens = min(usage.cached_tokens, prompt)
        if out.HasField("cum_log_probs"):
            out.cum_log_probs += self._base_cum_logprob
        # The continuation's prompt is the original one plus the delivered tokens; the client
        # asked about the original prompt only.
        prompt_logprobs.truncate(out, prompt)
        if out.weight_versions:
            joined = self._spans.join(self._spans_before, spans_of(out), self._base_tokens)
            del out.weight_versions[:]
            if joined is not None:
                out.weight_versions.extend(
                    sidecar_pb2.WeightVersionSpan(version=s.version, start=s.start, end=s.end) for s in joined
                )
                out.weight_version = joined[-1].version
        return out

    def _length_terminal(self) -> sidecar_pb2.LLMEngineOutput:
        prompt = len(self._original.token_ids)
        done = len(self._delivered)
        return sidecar_pb2.LLMEngineOutput(
            finish_reason=sidecar_pb2.LENGTH,
            completion_usage=sidecar_pb2.CompletionUsage(
                prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done
            ),
        )
