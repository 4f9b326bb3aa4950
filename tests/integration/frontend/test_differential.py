"""Differential test: the frontend over testkit engines answers each request as the real server does.

Each format has a table (``differential_vllm.json``, ``differential_sglang.json`` beside this
file): a request (valid, a bad input, or a fault the engine injects), and the real server's
answer beside it: status, content type, and the body or every SSE event, byte for byte. How
each answer was obtained is in its row's ``how``:

* ``"run"``: recorded by ``tools/record_differential.py`` from the real server's own HTTP code
  (vLLM 0.33.0, SGLang 0.5.23, the versions in the table's ``recorded_with``), with only the
  engine behind it replaced (see that script for exactly what is real and what stands in).
  vLLM's engine stand-in draws its tokens from ``testkit.generator``, the model the testkit
  engines serve, so generations compare token for token.
* ``"read: <file>:<function> ..."``: written by hand from reading that real code, because the
  stage that answers could not be run without the engine.

Rows that fail today because of a known bug carry ``xfail`` (issue 17's bullet): they are
marked ``xfail(strict=True)``, so they turn into failures the moment the bug is fixed and the
marker must come off. A row where we differ from the real server on purpose keeps the real
answer in ``real`` and ours in ``ours``, which is what is compared; its ``differs`` names the
bullet of the format's page (``docs/frontend-<format>.md``, "Where we differ from ..., on
purpose") that says why, and the two answers must really differ. Only what the real server
itself varies is normalised before comparing (vLLM's ``created`` clock, SGLang's latencies,
and the server-install-dependent endpoint context FastAPI appends to SGLang's parse-stage
messages; see ``_normalise``). A row's ``compare`` narrows what is compared, and its ``note``
says why or what in it is the stand-in's.

The requests go over loopback to the frontend (aiohttp) -> sidecar -> testkit engine: vLLM
rows over a vLLM sidecar, SGLang rows over an SGLang sidecar on SGLang's HTTP transport.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from testkit.faults import FaultKind, FaultPlan

from sidecar_frontend.formats.sglang import FORMAT as SGLANG
from sidecar_frontend.formats.vllm import FORMAT as VLLM
from tests.integration.frontend.fixtures import FrontendStack, frontend_over
from tests.sglang_fixtures import sglang_stack
from tests.vllm_fixtures import vllm_stack

pytestmark = pytest.mark.timeout(120)

HERE = Path(__file__).resolve().parent
TABLES = {fmt: json.loads((HERE / f"differential_{fmt}.json").read_text()) for fmt in ("vllm", "sglang")}
DEFAULT_COMPARE = ("status", "content_type", "body", "events")


def _rows(fmt: str) -> list[Any]:
    params = []
    for row in TABLES[fmt]["rows"]:
        marks = [pytest.mark.xfail(strict=True, reason=row["xfail"])] if "xfail" in row else []
        params.append(pytest.param(row, id=row["name"], marks=marks))
    return params


# The fault rows, as the testkit engine injects them (the recorder raises vLLM's own
# exception for the same row: engine_dead -> EngineDeadError after k tokens, engine_error ->
# EngineGenerateError after k tokens, overloaded -> QueueOverflowError at admission). An engine
# dead or failing is a fault plan for the row's request (the sidecar sees the engine's call fail
# either way, and its health tells a dead engine apart); an
# engine overloaded is the testkit's own admission control (vLLM's --max-num-queued-reqs) at 0
# while the row runs: it refuses as vLLM does, gRPC UNAVAILABLE with vLLM's sentence.
def _fault_plan(fault: dict[str, Any]) -> FaultPlan:
    if fault["kind"] in ("engine_dead", "engine_error"):
        return FaultPlan(FaultKind.ERROR_AFTER, after=fault["after"], code="INTERNAL")
    raise AssertionError(f"unknown fault {fault}")


@asynccontextmanager
async def _frontend(engine: str) -> AsyncIterator[FrontendStack]:
    sidecar_cm: Any = vllm_stack() if engine == "vllm" else sglang_stack("http")
    async with (
        sidecar_cm as sidecar,
        frontend_over([f"127.0.0.1:{sidecar.server.port}"], [sidecar], formats=(SGLANG, VLLM)) as fe,
    ):
        yield fe


async def _held(engine: str) -> AsyncIterator[FrontendStack]:
    """One stack for a whole table. Its task groups must be entered and left by one task, and
    a fixture's setup and teardown run in different ones: a task of its own holds it open."""
    ready: asyncio.Future[FrontendStack] = asyncio.get_running_loop().create_future()
    done = asyncio.Event()

    async def hold() -> None:
        try:
            async with _frontend(engine) as fe:
                ready.set_result(fe)
                await done.wait()
        except BaseException as err:
            if not ready.done():
                ready.set_exception(err)
            raise

    holder = asyncio.create_task(hold())
    try:
        yield await asyncio.wait_for(ready, 60)
    finally:
        done.set()
        await asyncio.wait_for(holder, 60)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def vllm_frontend() -> AsyncIterator[FrontendStack]:
    async for fe in _held("vllm"):
        yield fe


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def sglang_frontend() -> AsyncIterator[FrontendStack]:
    async for fe in _held("sglang"):
        yield fe


async def _answer(fe: FrontendStack, request: dict[str, Any]) -> dict[str, Any]:
    headers = dict(request.get("headers", {}))
    if "json" in request:
        data = json.dumps(request["json"]).encode()
        headers.setdefault("content-type", "application/json")
    else:
        data = request.get("body", "").encode()
    async with fe.http.request(
        request.get("method", "POST"), fe.url + request["path"], data=data, headers=headers
    ) as response:
        raw = (await response.read()).decode()
        answer: dict[str, Any] = {
            "status": response.status,
            "content_type": response.headers.get("Content-Type"),
        }
    if (answer["content_type"] or "").startswith("text/event-stream"):
        assert raw.endswith("\n\n"), raw
        blocks = raw.split("\n\n")[:-1]
        assert all(b.startswith("data: ") for b in blocks), blocks
        answer["events"] = [b[len("data: ") :] for b in blocks]
    else:
        answer["body"] = raw
    return answer


_CREATED = re.compile(r'"created":\d+')
# SGLang's timings (seconds since arrival, and a wall-clock stamp).
_TIMINGS = re.compile(r'"(e2e_latency|response_sent_to_client_ts)":[-+0-9.eE]+')
_ENDPOINT_CONTEXT = "\n\n  File "


def _normalise(text: str) -> str:
    """What the real server varies by itself, made equal on both sides."""
    text = _CREATED.sub('"created":0', text)
    text = _TIMINGS.sub(r'"\1":0.0', text)
    # FastAPI (SGLang's parse stage) appends where the endpoint lives in the server's install
    # (a file path and line) and the error list again; nothing a client can rely on.
    if text.startswith('{"object":"error"'):
        body = json.loads(text)
        message = body["message"]
        if isinstance(message, str) and _ENDPOINT_CONTEXT in message:
            body["message"] = message.split(_ENDPOINT_CONTEXT, 1)[0]
            text = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    return text


def _comparable(answer: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    view: dict[str, Any] = {}
    for key in keys:
        if key not in answer:
            continue
        value = answer[key]
        if key == "body":
            value = _normalise(value)
        elif key == "events":
            value = [_normalise(event) for event in value]
        view[key] = value
    return view


async def _check(fe: FrontendStack, row: dict[str, Any]) -> None:
    assert "real" in row, f"row {row['name']!r} has no recorded answer"
    engine = fe.sidecars[0].engine
    overloaded = row.get("fault", {}).get("kind") == "overloaded"
    if "fault" in row and not overloaded:
        request_id = row["request"]["json"]["request_id"]
        engine.faults.add(request_id, _fault_plan(row["fault"]))
    if overloaded:
        engine.max_num_queued_reqs = 0
    try:
        ours = await _answer(fe, row["request"])
    finally:
        if overloaded:
            engine.max_num_queued_reqs = engine.config.max_num_queued_reqs
    keys = tuple(row.get("compare", DEFAULT_COMPARE))
    expected = row.get("ours", row["real"])
    assert _comparable(ours, keys) == _comparable(expected, keys), row.get("differs", row["how"])


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("row", _rows("vllm"))
async def test_vllm_answers_as_vllm(vllm_frontend: FrontendStack, row: dict[str, Any]) -> None:
    await _check(vllm_frontend, row)


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("row", _rows("sglang"))
async def test_sglang_answers_as_sglang(sglang_frontend: FrontendStack, row: dict[str, Any]) -> None:
    await _check(sglang_frontend, row)


def _on_purpose(fmt: str) -> str:
    """The format page's section listing where we differ from the real server on purpose."""
    page = (HERE.parents[2] / "docs" / f"frontend-{fmt}.md").read_text()
    heading = re.search(r"^## Where we differ from .*, on purpose$", page, re.MULTILINE)
    assert heading is not None, fmt
    rest = page[heading.end() :]
    following = re.search(r"^## ", rest, re.MULTILINE)
    return rest[: following.start()] if following else rest


def test_every_row_says_how_its_answer_was_obtained() -> None:
    for fmt, table in TABLES.items():
        assert table["recorded_with"].split()[0] == fmt
        for row in table["rows"]:
            assert row["how"] == "run" or row["how"].startswith("read: "), (fmt, row["name"])
            assert {"status", "content_type"} <= set(row["real"]), (fmt, row["name"])
            if "xfail" in row:
                assert row["xfail"].startswith("issue 17: "), (fmt, row["name"])
            assert ("ours" in row) == ("differs" in row), (fmt, row["name"])
            if "ours" in row:
                # A deliberate difference: documented, and a difference indeed.
                assert f"- **{row['differs']}**" in _on_purpose(fmt), (fmt, row["name"])
                keys = tuple(row.get("compare", DEFAULT_COMPARE))
                assert _comparable(row["ours"], keys) != _comparable(row["real"], keys), (fmt, row["name"])
