"""A trainer's pause and weight update behind the frontend, with real processes: a testkit SGLang
HTTP engine registered bare through ``POST /workers`` on a ``sidecar-frontend
--route-latest-weights``, paused through the engine's own ``/pause_generation``: the worker is
listed ``paused``, a request sent meanwhile waits in the frontend (``frontend_requests_held``),
the engine's weights are updated to a new version and it continues: the request is served, by
the new version, and the fleet's newest version is the new one (``GET /weight_version``, the
log)."""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import pytest

from tests.e2e_helpers import WAIT, free_port, process
from tests.process.test_bare_engines_process import SGLANG_HTTP, Frontend, frontend
from tests.process.test_membership_process import call, until_serving

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow(20)]

PROMPT = [101, 202, 303, 404]


def row(fe: Frontend, url: str, matches: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """GET /workers until the worker's row ``matches`` (bounded); that row."""
    deadline = time.monotonic() + WAIT
    while True:
        _, listed = call("GET", fe.url + "/workers")
        rows = [r for r in listed["workers"] if r["url"] == url]
        if rows and matches(rows[0]):
            return dict(rows[0])
        assert time.monotonic() < deadline, f"never so: {listed}"
        time.sleep(0.05)  # polling a real process: there is no event to wait on


def held(fe: Frontend) -> float:
    with urllib.request.urlopen(fe.metrics + "/metrics", timeout=WAIT) as response:
        text = response.read().decode()
    found = re.search(r"^frontend_requests_held (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_paused_bare_engine_holds_requests_and_its_new_weights_become_the_newest() -> None:
    with ExitStack() as stack:
        port = free_port()
        stack.enter_context(process(SGLANG_HTTP.argv(port)))
        fe = stack.enter_context(frontend("--route-latest-weights", "--paused-hold-secs", "120"))
        body = SGLANG_HTTP.body(port)
        status, accepted = call("POST", fe.url + "/workers", body)
        assert status == 202, accepted
        url = body["url"]
        until_serving(fe.url, url)
        row(fe, url, lambda r: r["weight_version"] is not None)  # its launch version, reported
        engine = f"http://127.0.0.1:{port}"

        assert call("POST", engine + "/pause_generation", {"mode": "in_place"})[0] == 200
        paused = row(fe, url, lambda r: r["state"] == "paused")
        assert paused["is_healthy"] is True, "paused is not down"

        answers: list[tuple[int, Any]] = []
        request = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}}
        sender = threading.Thread(target=lambda: answers.append(call("POST", fe.url + "/generate", request)))
        sender.start()
        deadline = time.monotonic() + WAIT
        while held(fe) < 1:
            assert time.monotonic() < deadline, "the request was never held"
            time.sleep(0.05)  # a real process's metric: there is no event to wait on
        assert answers == []

        update = {"new_version": "step-9", "abort_all_requests": False}
        assert call("POST", engine + "/update_weight_version", update)[0] == 200
        assert call("POST", engine + "/continue_generation")[0] == 200
        sender.join(WAIT)
        assert len(answers) == 1
        status, answer = answers[0]
        assert status == 200, answer
        assert answer["meta_info"]["weight_version"] == "step-9"
        assert len(answer["output_ids"]) == 4

        status, version = call("GET", fe.url + "/weight_version")
        assert status == 200, version
        assert version["weight_version"] == "step-9"
        assert version["route_latest_weights"] is True
        assert row(fe, url, lambda r: r["state"] == "serving")["weight_version"] == "step-9"
        fe.log.wait_for(lambda e: e.get("event") == "worker paused")
        fe.log.wait_for(lambda e: e.get("event") == "requests held")
        fe.log.wait_for(
            lambda e: e.get("event") == "fleet newest weight version" and e.get("weight_version") == "step-9"
        )
