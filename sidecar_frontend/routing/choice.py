"""The routing policy as the attempt runner asks for it: the router over the worker set.

:class:`RoutedChoice` is a worker choice (``sidecar_frontend.placement.WorkerChoice``): asked
for a worker of a role, it turns the serving workers of that role and model into the router's
targets (their block size, whether their cache stream is live, the requests they run, the
prefill this frontend queued there), asks the router, counts the decision and remembers it for
the call. Decode workers are chosen by load (their prompt comes from the prefill worker's
cache, not their own); with ``--routing load`` (no router) every role is.

It also watches each call it chose the worker of (:meth:`RoutedChoice.watch`, a
``placement.CallWatch``): the request's
uncached prompt tokens count as prefill queued on the worker from the call to its first output,
and the engine's usage, when it arrives, is counted against the prediction.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Final

from sidecar_common.api import sidecar_pb2
from sidecar_common.disaggregation import Role
from sidecar_common.kv_request import cacheable, key_namespace
from sidecar_frontend.registry import available_first
from sidecar_frontend.routing.metrics import RoutingMetrics
from sidecar_frontend.routing.policy import Decision, Reason
from sidecar_frontend.routing.router import Prompt, Router, Target
from sidecar_frontend.routing.streams import CacheStreams
from sidecar_frontend.workers import Worker, WorkerSet

__all__ = ["RoutedChoice", "prompt_of"]

# Decisions waiting for their call. A choice the runner drops (a prefill worker found, then no
# decode worker) never gets one; the oldest go past this many.
_PENDING_LIMIT: Final = 4096


def prompt_of(request: sidecar_pb2.PreprocessedRequest) -> Prompt:
    """What the cache keys of ``request`` depend on: its tokens, LoRA adapter and cache salt
    (``routing.cache_namespace``: vLLM's ``cache_salt``). Requests with images or other media
    are not cacheable by tokens alone."""
    lora_name, cache_salt = key_namespace(request)
    return Prompt(request.token_ids, lora_name=lora_name, cache_salt=cache_salt, cacheable=cacheable(request))


class RoutedChoice:
    """Chooses the worker of each call, and watches the calls it chose for."""

    def __init__(
        self,
        workers: WorkerSet,
        router: Router | None,
        *,
        streams: CacheStreams | None = None,
        metrics: RoutingMetrics | None = None,
        clock: Callable[[], float],
        with_room: Callable[[Sequence[Worker]], list[Worker]] | None = None,
    ) -> None:
        self.workers = workers
        self.router = router
        # Admission's reading of which workers have a free slot (None: admission is off).
        self.with_room = with_room
        self.streams = streams
        self.metrics = metrics
        self._clock = clock
        self._pending: OrderedDict[tuple[str, str], tuple[Role, Decision]] = OrderedDict()

    def __call__(
        self,
        role: Role,
        model: str,
        request: sidecar_pb2.PreprocessedRequest,
        exclude: frozenset[str],
    ) -> Worker | None:
        """A serving worker of ``role`` serving ``model`` for ``request``, not in ``exclude``."""
        router = self.router
        if router is None or role == "decode":
            worker = self._pick(role, model, exclude)
            if worker is None:
                return None
            decision = Decision(worker.address, Reason.LOAD, 0)
        else:
            # A worker on probation with its probe in flight is no candidate (unless it is the
            # only one), as in the worker set's own pick.
            candidates = self._room_first(
                available_first([w for w in self.workers.serving(role, model) if w.address not in exclude])
            )
            found = router.choose(
                model,
                prompt_of(request),
                [self._target(w) for w in candidates],
                self._clock(),
                turn_key=f"{role}/{model}",
            )
            if found is None:
                return None
            decision = found
            worker = next(w for w in candidates if w.address == decision.worker)
        if self.metrics is not None:
            self.metrics.decided(role, decision.reason.value)
        pending = self._pending
        pending[(request.request_id, worker.address)] = (role, decision)
        while len(pending) > _PENDING_LIMIT:
            pending.popitem(last=False)
        return worker

    def _room_first(self, candidates: list[Worker]) -> list[Worker]:
        """The candidates with a free slot, when admission is on and any has one; else all.
        Admission let the request in because some worker had room: a worker at its running
        limit would queue it in its engine behind a whole decode step or more (bench.overload:
        an urgent request that preempted a slot on one worker, routed to a full one, had its
        first token after 130 ms against 82 ms at most from the slot it made)."""
        if self.with_room is None:
            return candidates
        return self.with_room(candidates) or candidates

    def _pick(self, role: Role, model: str, exclude: frozenset[str]) -> Worker | None:
        """The worker set's own choice (by load), among the workers with room first."""
        if self.with_room is not None:
            serving = [w for w in self.workers.serving(role, model) if w.address not in exclude]
            roomy = {w.address for w in self.with_room(serving)}
            if roomy:
                full = frozenset(w.address for w in serving if w.address not in roomy)
                worker = self.workers.pick(role, exclude=exclude | full, model=model)
                if worker is not None:
                    return worker
        return self.workers.pick(role, exclude=exclude, model=model)

    def predicted_cached(
        self, model: str, request: sidecar_pb2.PreprocessedRequest, workers: Sequence[Worker]
    ) -> dict[str, int]:
        """The prompt tokens of ``request`` each of ``workers`` is predicted to hold cached, as
        the router weighs them (none held: left out; no router: nothing); read only."""
        if self.router is None:
            return {}
        return self.router.predicted_cached(model, prompt_of(request), [self._target(w) for w in workers])

    @contextmanager
    def watch(
        self, worker: Worker, request: sidecar_pb2.PreprocessedRequest
    ) -> Iterator[Callable[[sidecar_pb2.LLMEngineOutput], None]]:
        """For the ``with`` block of a Generate call of ``request`` on ``worker``: a function
        to give each of its outputs to. A call this choice did not choose for (or a decode
        step) is watched for nothing."""
        pending = self._pending.pop((request.request_id, worker.address), None)
        if pending is None or pending[0] == "decode":
            yield _ignore
            return
        decision = pending[1]
        queued = max(0, len(request.token_ids) - decision.cached_tokens)
        worker.queued_prefill_tokens += queued
        observed = False

        def prefilled() -> None:
            nonlocal queued
            if queued:
                worker.queued_prefill_tokens = max(0, worker.queued_prefill_tokens - queued)
                queued = 0

        def observe(output: sidecar_pb2.LLMEngineOutput) -> None:
            # The first output ends the prefill; the first with the engine's cached-token count
            # is counted against the prediction.
            nonlocal observed
            prefilled()
            if observed or not output.HasField("completion_usage"):
                return
            usage = output.completion_usage
            if not usage.HasField("cached_tokens"):
                return
            observed = True
            if self.metrics is not None:
                self.metrics.usage(
                    worker.address,
                    predicted=decision.cached_tokens,
                    reported=usage.cached_tokens,
                    prompt=usage.prompt_tokens or len(request.token_ids),
                )

        try:
            yield observe
        finally:
            prefilled()

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


def _ignore(output: sidecar_pb2.LLMEngineOutput) -> None:
    """Watching a call for nothing."""
