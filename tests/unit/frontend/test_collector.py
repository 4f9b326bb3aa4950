"""The frontend's collector thresholds follow the admission backlog: the serving ones, the
backlog ones from when a request starts waiting until none waits (sidecar_frontend/collector.py;
why, there). The gate tells it from its ticker."""

from __future__ import annotations

import anyio

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.admission.gate import Gate, Pass
from sidecar_frontend.admission.state import AdmissionSettings, Refused
from sidecar_frontend.collector import BACKLOG_THRESHOLDS, SERVING_THRESHOLDS, CollectorThresholds
from sidecar_frontend.config import AdmissionConfig
from tests.e2e_helpers import until
from tests.unit.frontend.test_preempt_gate import LOW, MODEL, OTHER, Clock, OneWorker, StandInWorker


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, *thresholds: int) -> None:
        self.calls.append(thresholds)


def test_the_thresholds_change_once_each_way() -> None:
    recorder = Recorder()
    collector = CollectorThresholds(recorder)
    assert recorder.calls == [SERVING_THRESHOLDS]
    collector.backlog(True)
    collector.backlog(True)
    assert recorder.calls == [SERVING_THRESHOLDS, BACKLOG_THRESHOLDS]
    collector.backlog(False)
    collector.backlog(False)
    assert recorder.calls == [SERVING_THRESHOLDS, BACKLOG_THRESHOLDS, SERVING_THRESHOLDS]
    assert BACKLOG_THRESHOLDS[0] < SERVING_THRESHOLDS[0]


async def test_the_gate_tells_when_requests_start_and_stop_waiting() -> None:
    told: list[bool] = []
    view = OneWorker(StandInWorker("w:1", sidecar_pb2.ModelInfo(max_num_seqs=1)))
    config = AdmissionConfig(
        settings=AdmissionSettings(max_queue_depth=8, max_queue_wait=60.0, headroom=0.0), tick=0.005
    )
    gate = Gate(view, config, clock=Clock(), on_backlog=told.append)
    async with anyio.create_task_group() as group:
        group.start_soon(gate.run_ticker)
        with anyio.fail_after(30):
            running = await gate.enter(MODEL, LOW, 10, 1)
            assert isinstance(running, Pass)
            assert told == []  # admitted at once: nothing waits
            waiting: list[Pass | Refused] = []

            async def enter() -> None:
                waiting.append(await gate.enter(MODEL, OTHER, 10, 1))

            group.start_soon(enter)
            await until(lambda: told == [True], "the backlog is told")
            running.release(10)  # the slot frees: the waiting request is admitted
            await until(lambda: told == [True, False], "the end of the backlog is told")
            (admitted,) = waiting
            assert isinstance(admitted, Pass)
            admitted.release(10)
        group.cancel_scope.cancel()
