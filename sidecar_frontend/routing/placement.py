"""The worker choice as the attempt runner asks for it: the router over the worker set.

:class:`Placer` turns the serving workers of a role and model into the router's targets (their
block size, whether their cache stream is live, the requests they run, the prefill this
frontend queued there), asks the router, and counts the decision. With ``--routing load`` (or
no router) it is the worker set's own power of two choices.

A :class:`Placement` then follows the call it was made for: the request's uncached prompt
tokens count as queued prefill on the worker from the call to its first output
(:meth:`Placement.queued`), and the engine's usage, when it arrives, is counted against the
prediction (:meth:`Placement.observe`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.routing.metrics import RoutingMetrics
from sidecar_frontend.routing.policy import Decision, Reason
from sidecar_frontend.routing.router import Prompt, Router, Target
from sidecar_frontend.routing.streams import CacheStreams
from sidecar_frontend.workers import Worker, WorkerSet

__all__ = ["Placement", "Placer", "prompt_of"]


def prompt_of(request: sidecar_pb2.PreprocessedRequest) -> Prompt:
    """What the cache keys of ``request`` depend on: its tokens, LoRA adapter and cache salt
    (``routing.cache_namespace``: vLLM's ``cache_salt``). Requests with images or other media
    are not cacheable by tokens alone."""
    routing = request.routing
    return Prompt(
        request.token_ids,
        lora_name=routing.lora_name if routing.HasField("lora_name") and routing.lora_name else None,
        cache_salt=routing.cache_namespace
        if routing.HasField("cache_namespace") and routing.cache_namespace
        else None,
        cacheable=not request.multi_modal_data,
    )


@dataclass(eq=False)
class Placement:
    """One worker chosen for one call."""

    worker: Worker
    decision: Decision
    prompt_tokens: int
    metrics: RoutingMetrics | None = None
    _queued: int = field(default=0, init=False)
    _observed: bool = field(default=False, init=False)

    @property
    def predicted_cached_tokens(self) -> int:
        return self.decision.cached_tokens

    @contextmanager
    def queued(self) -> Iterator[None]:
        """The request's uncached prompt counts as prefill queued on the worker until
        :meth:`prefilled` (its first output) or the end of the ``with`` block."""
        self._queued = max(0, self.prompt_tokens - self.decision.cached_tokens)
        self.worker.queued_prefill_tokens += self._queued
        try:
            yield
        finally:
            self.prefilled()

    def prefilled(self) -> None:
        if self._queued:
            self.worker.queued_prefill_tokens = max(0, self.worker.queued_prefill_tokens - self._queued)
            self._queued = 0

    def observe(self, output: sidecar_pb2.LLMEngineOutput) -> None:
        """An output of the call, as the worker sent it: its first is the end of the prefill;
        the first with the engine's cached-token count is counted against the prediction."""
        self.prefilled()
        if self._observed or not output.HasField("completion_usage"):
            return
        usage = output.completion_usage
        if not usage.HasField("cached_tokens"):
            return
        self._observed = True
        if self.metrics is not None:
            self.metrics.usage(
                self.worker.address,
                predicted=self.decision.cached_tokens,
                reported=usage.cached_tokens,
                prompt=usage.prompt_tokens or self.prompt_tokens,
            )


class Placer:
    """Chooses the worker of each call."""

    def __init__(
        self,
        workers: WorkerSet,
        router: Router | None,
        *,
        streams: CacheStreams | None = None,
        metrics: RoutingMetrics | None = None,
        clock: Callable[[], float],
    ) -> None:
        self.workers = workers
        self.router = router
        self.streams = streams
        self.metrics = metrics
        self._clock = clock

    def pick(
        self,
        role: str,
        request: sidecar_pb2.PreprocessedRequest,
        *,
        exclude: frozenset[str] = frozenset(),
        model: str | None = None,
    ) -> Placement | None:
        """A serving worker of ``role`` (and ``model``) not in ``exclude`` for ``request``."""
        router = self.router
        prompt_tokens = len(request.token_ids)
        if router is None or role == "decode":
            # A decode worker's prompt comes from its prefill worker's cache, not its own.
            worker = self.workers.pick(role, exclude=exclude, model=model)
            if worker is None:
                return None
            decision = Decision(worker.address, Reason.LOAD, 0)
        else:
            candidates = [w for w in self.workers.serving(role, model) if w.address not in exclude]
            if not candidates:
                return None
            by_address = {w.address: w for w in candidates}
            served = model if model is not None else candidates[0].served_model
            found = router.choose(
                served,
                prompt_of(request),
                [self._target(w) for w in candidates],
                self._clock(),
                turn_key=f"{role}/{served}",
            )
            if found is None:
                return None
            decision = found
            worker = by_address[decision.worker]
        if self.metrics is not None:
            self.metrics.decided(role, decision.reason.value)
        if role == "decode":
            # It prefills nothing, and its cached tokens are the prefill's handoff, not a hit of
            # its own cache: neither counts.
            return Placement(worker, decision, 0, None)
        return Placement(worker, decision, prompt_tokens, self.metrics)

    def _target(self, worker: Worker) -> Target:
        streams = self.streams
        block_size = streams.block_size(worker.address) if streams is not None else 0
        if not block_size and worker.model is not None:
            block_size = worker.model.kv_block_size
        return Target(
            worker.address,
            block_size,
            publishes=streams is not None and streams.publishes(worker.address),
            running=worker.score(),
            queued_prefill_tokens=worker.queued_prefill_tokens,
        )
