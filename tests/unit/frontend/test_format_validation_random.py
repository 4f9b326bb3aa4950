"""Random bodies, the real servers' answers: the format plugins refuse them in the same words.

``data/validation_random_{vllm,sglang}.json`` hold 400 bodies per format drawn from a fixed
seed (lax and wrong values for the request fields) with the answer the real server's own
HTTP code gave each (vLLM 0.33.0's router, SGLang 0.5.23's app; the engine replaced), recorded
by ``tools/record_differential.py --random 400``. A refusal must be the same status and the
same body, byte for byte; a body the real server accepts must be accepted here too, or refused
by name as something this frontend cannot carry (docs/frontend-*.md). SGLang bodies that got
past every stage the recorder runs (``status`` null) are not compared.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.formats import sglang, vllm
from sidecar_frontend.formats.base import FormatContext, HttpReply, parse_whole

DATA = Path(__file__).resolve().parent / "data"
HEADERS = {"Content-Type": "application/json"}
# What the recorder's stand-ins serve: the testkit model.
INFO = sidecar_pb2.ModelInfo(
    served_model_name="testkit-model",
    max_context_length=4096,
    vocab_size=32000,
    max_num_seqs=256,
    data_parallel_size=1,
    eos_token_ids=[2],
)


def _rows(fmt: str) -> list[Any]:
    table = json.loads((DATA / f"validation_random_{fmt}.json").read_text())
    return [pytest.param(row, id=f"{fmt}-{index}") for index, row in enumerate(table["rows"])]


def _answer(fmt: str, body: object) -> object:
    ctx = FormatContext(model_info=INFO, new_id=lambda: "0" * 32, wall_time=0.0)
    raw = json.dumps(body).encode()
    if fmt == "vllm":
        return parse_whole(vllm.FORMAT, vllm.GENERATE, raw, HEADERS, ctx)
    return parse_whole(sglang.FORMAT, sglang.GENERATE, raw, HEADERS, ctx)


def _refused_by_name(reply: HttpReply) -> bool:
    return reply.status == 400 and b"is not supported by this server" in reply.body


@pytest.mark.parametrize("row", _rows("vllm") + _rows("sglang"))
def test_a_random_body_gets_the_real_servers_answer(row: dict[str, Any]) -> None:
    fmt = "vllm" if "token_ids" in row["body"] else "sglang"
    real = row["real"]
    ours = _answer(fmt, row["body"])
    if real["status"] is None:
        return
    if real["status"] == 200:
        assert not isinstance(ours, HttpReply) or _refused_by_name(ours), ours
        return
    assert isinstance(ours, HttpReply), ours
    assert (ours.status, ours.body.decode()) == (real["status"], real["body"])


def test_the_tables_hold_refusals_and_accepted_bodies() -> None:
    # A table that lost its refusals (a recording gone wrong) would make the test above vacuous.
    for fmt in ("vllm", "sglang"):
        rows = json.loads((DATA / f"validation_random_{fmt}.json").read_text())["rows"]
        statuses = [row["real"]["status"] for row in rows]
        assert sum(status == 400 for status in statuses) > 100, fmt
        assert sum(status != 400 for status in statuses) > 10, fmt
