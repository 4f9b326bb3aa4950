"""The one log line of a refused Generate says why and carries the request id, whatever the
refusal (not serving, an invalid request), including a request the frontend sent unnamed."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from sidecar_common.api import sidecar_pb2
from tests.unit.test_metrics import drain, request, sidecar

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("serving", "sent", "reason", "says"),
    [
        (False, request("while-starting"), "ENGINE_SHUTDOWN", "not serving"),
        (True, sidecar_pb2.PreprocessedRequest(request_id="no-tokens"), "INVALID_ARGUMENT", "token_ids"),
        (True, sidecar_pb2.PreprocessedRequest(), "INVALID_ARGUMENT", "token_ids"),
        (False, sidecar_pb2.PreprocessedRequest(token_ids=[1, 2]), "ENGINE_SHUTDOWN", "not serving"),
    ],
    ids=["not serving", "invalid", "invalid and unnamed", "not serving and unnamed"],
)
async def test_a_refused_request_is_one_line_saying_why_with_its_id(
    serving: bool, sent: sidecar_pb2.PreprocessedRequest, reason: str, says: str
) -> None:
    async with sidecar(serving=serving) as s:
        with capture_logs() as logs:
            await drain(s.stub.Generate(sent))
    lines = [e for e in logs if e["event"].startswith("generate")]
    assert len(lines) == 1, lines
    (line,) = lines
    assert line["event"] == "generate refused"
    assert line["log_level"] == "info"
    assert line["reason"] == reason
    assert says in line["error"]
    # The id the frontend sent, or the one the sidecar gave an unnamed request: never empty.
    assert line["public_id"] == (sent.request_id or line["public_id"])
    assert line["public_id"]
