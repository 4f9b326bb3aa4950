"""A request queued for admission while its model's fleet is held (every worker paused by its
trainer) is not refused for the wait: the held time does not count against
--max-queue-wait-secs, and once the fleet continues the request has what was left of its wait.
One model on one stand-in worker of one running slot; the gate's clock is the test's."""

from __future__ import annotations

from dataclasses import dataclass

import anyio

from sidecar_common.api import sidecar_pb2
from sidecar_common.errors import RefusalReason
from sidecar_frontend.admission.gate import Gate, Pass
from sidecar_frontend.admission.state import AdmissionSettings, Refused
from sidecar_frontend.config import AdmissionConfig
from tests.e2e_helpers import until
from tests.unit.frontend.test_preempt_gate import LOW, MODEL, OTHER, Clock, OneWorker, StandInWorker

MAX_WAIT = 60.0


@dataclass
class Held:
    """The fleet's hold as the gate asks it, counting the asks (one per tick while a request
    waits: how the test knows the ticker looked)."""

    now: bool = True
    asked: int = 0

    def __call__(self, model: str) -> bool:
        assert model == MODEL
        self.asked += 1
        return self.now


async def test_a_queued_request_is_not_refused_while_its_fleet_is_held() -> None:
    clock, held = Clock(), Held()
    view = OneWorker(StandInWorker("w:1", sidecar_pb2.ModelInfo(max_num_seqs=1)))
    config = AdmissionConfig(
        settings=AdmissionSettings(max_queue_depth=8, max_queue_wait=MAX_WAIT, headroom=0.0), tick=0.005
    )
    gate = Gate(view, config, clock=clock, held=held)
    async with anyio.create_task_group() as group:
        group.start_soon(gate.run_ticker)
        with anyio.fail_after(30):
            running = await gate.enter(MODEL, LOW, 10, 1)
            assert isinstance(running, Pass)
            waiting: list[Pass | Refused] = []

            async def enter() -> None:
                waiting.append(await gate.enter(MODEL, OTHER, 10, 1))

            group.start_soon(enter)
            await until(lambda: gate.queued().get(MODEL) == {(0, "other"): 1}, "the request queues")

            async def ticks(count: int) -> None:
                seen = held.asked
                await until(lambda: held.asked >= seen + count, "the ticker looked")

            clock.now = 100.0  # well past its wait, but held all along
            await ticks(2)
            assert waiting == []
            held.now = False  # the fleet continues: it has its whole wait from now
            await ticks(2)
            clock.now = 100.0 + MAX_WAIT - 1.0
            await ticks(2)
            assert waiting == []
            clock.now = 100.0 + MAX_WAIT
            await until(lambda: bool(waiting), "the request is refused once its own wait is over")
            (refused,) = waiting
            assert isinstance(refused, Refused)
            assert refused.reason is RefusalReason.QUEUE_TIMEOUT
            running.release(10)
        group.cancel_scope.cancel()
