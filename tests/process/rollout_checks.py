"""What a rollout through the frontend must look like, checked after the fact (pure: no I/O, no
clock; every time is a number the trainer recorded).

The trainer (``rollout_trainer.py``) records each turn it sent (its prompt, budget, the time it
went out and the time its answer came back, the answer), each weight version it published at the
engines (when the first update was asked and when the last was answered), and which engines each
request reached (read from the engines' own books at the end). These functions say what is wrong
with such a record, one sentence per problem, so that a failing test names every broken turn:

* an answer: 200, ``finish_reason`` length with exactly the budget of output ids, the very ids
  the testkit's deterministic generator makes for the prompt (a resumed generation included:
  the generator is autoregressive, so a continuation makes the rest of the same stream), and the
  routed experts SGLang would answer for the whole sequence from ``routed_experts_start_len``;
* its weight-version spans: tiling ``[0, n)``, versions rising in publication order, none older
  than the newest published before the turn was sent, none not yet asked for when it came back;
* sessions: every request of a session reached one engine.
"""

from __future__ import annotations

import base64
import itertools
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from testkit.generator import ModelSpec, SamplingSpec, generate
from testkit.routed_experts import ExpertsShape, routed_experts

__all__ = [
    "Published",
    "TurnRecord",
    "answer_problems",
    "expected_experts",
    "expected_output",
    "legs_by_rid",
    "rid_of_private_id",
    "session_problems",
    "span_problems",
]


@dataclass(frozen=True)
class Published:
    """A weight version the trainer set on every engine: ``asked_at`` when the first engine was
    asked to take it (it exists nowhere before), ``answered_at`` when the last one had it."""

    version: str
    asked_at: float
    answered_at: float


@dataclass(frozen=True)
class TurnRecord:
    """One request of a session as the trainer sent it and what came back."""

    session: str
    turn: int
    rid: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    experts_start: int
    sent_at: float
    answered_at: float
    status: int
    answer: Any  # the JSON body, or the text of a body that was not JSON


def expected_output(prompt: Sequence[int], max_new_tokens: int, model: ModelSpec) -> list[int]:
    """The ids a testkit engine makes for ``prompt`` with this budget and ``ignore_eos``."""
    sampling = SamplingSpec(max_tokens=max_new_tokens, ignore_eos=True)
    return [t.token_id for t in generate(model, prompt, sampling)]


def expected_experts(sequence: Sequence[int], start: int, shape: ExpertsShape) -> list[int]:
    """The routed experts SGLang answers for ``sequence`` (prompt then output) from ``start``,
    flattened (positions, layers, experts per token)."""
    rows = routed_experts(sequence, start, shape)
    return [e for row in rows for layer in row for e in layer]


def _decoded(text: object) -> list[int] | str:
    """The int32s of a base64 little-endian array, or why it is not one."""
    if not isinstance(text, str):
        return f"routed_experts is {type(text).__name__}, not base64 text"
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError as err:
        return f"routed_experts is not base64: {err}"
    if len(raw) % 4:
        return f"routed_experts has {len(raw)} bytes, not whole int32s"
    return list(struct.unpack(f"<{len(raw) // 4}i", raw))


def answer_problems(record: TurnRecord, model: ModelSpec, shape: ExpertsShape) -> list[str]:
    """What is wrong with one answer (empty: nothing)."""
    name = f"{record.rid}"
    if record.status != 200 or not isinstance(record.answer, dict):
        return [f"{name}: answered {record.status}: {str(record.answer)[:300]}"]
    problems: list[str] = []
    meta = record.answer.get("meta_info", {})
    output = record.answer.get("output_ids")
    finish = meta.get("finish_reason")
    if not isinstance(finish, dict) or finish.get("type") != "length":
        problems.append(f"{name}: finish_reason {finish}, not length")
    if not isinstance(output, list):
        return [*problems, f"{name}: no output_ids: {str(record.answer)[:300]}"]
    if len(output) != record.max_new_tokens:
        problems.append(f"{name}: {len(output)} output ids, not the budget {record.max_new_tokens}")
    if meta.get("completion_tokens") != len(output):
        problems.append(f"{name}: completion_tokens {meta.get('completion_tokens')} for {len(output)} ids")
    expected = expected_output(record.prompt, record.max_new_tokens, model)
    if output != expected:
        first = next((i for i, (a, b) in enumerate(zip(output, expected, strict=False)) if a != b), None)
        problems.append(
            f"{name}: output ids differ from the generator's (first at {first}): {output} != {expected}"
        )
    experts = _decoded(meta.get("routed_experts"))
    if isinstance(experts, str):
        problems.append(f"{name}: {experts}")
    else:
        sequence = [*record.prompt, *output]
        width = shape.num_layers * shape.top_k
        rows = len(sequence) - 1 - record.experts_start
        if len(experts) != rows * width:
            problems.append(
                f"{name}: {len(experts)} routed expert values, not ({len(sequence)} - 1 - "
                f"{record.experts_start}) * {width} = {rows * width}"
            )
        elif experts != expected_experts(sequence, record.experts_start, shape):
            problems.append(f"{name}: routed experts differ from the engine's routing of the sequence")
    return problems


def span_problems(record: TurnRecord, published: Sequence[Published], launch_version: str) -> list[str]:
    """What is wrong with one 200 answer's ``meta_info.weight_versions`` (empty: nothing).
    ``published``: in the order the trainer published them, after ``launch_version``."""
    if record.status != 200 or not isinstance(record.answer, dict):
        return []  # answer_problems says so
    name = record.rid
    meta = record.answer.get("meta_info", {})
    spans = meta.get("weight_versions")
    count = len(record.answer.get("output_ids") or [])
    if not isinstance(spans, list) or not spans or not all(isinstance(s, dict) for s in spans):
        return [f"{name}: weight_versions {spans!r} is not a list of spans"]
    problems: list[str] = []
    order = [launch_version, *(p.version for p in published)]
    bounds = [(s.get("start"), s.get("end")) for s in spans]
    tiles = bounds[0][0] == 0 and bounds[-1][1] == count
    tiles = tiles and all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    tiles = tiles and all(isinstance(b, int) and isinstance(e, int) and b < e for b, e in bounds)
    if not tiles:
        problems.append(f"{name}: spans {spans} do not tile [0, {count})")
    versions = [s.get("version") for s in spans]
    unknown = [v for v in versions if v not in order]
    if unknown:
        return [*problems, f"{name}: spans name versions never published: {unknown}"]
    ranks = [order.index(v) for v in versions]
    if any(a >= b for a, b in itertools.pairwise(ranks)):
        problems.append(f"{name}: span versions {versions} do not rise in publication order")
    # The newest version every engine had before the turn went out: its tokens come after that.
    floor = max((i + 1 for i, p in enumerate(published) if p.answered_at <= record.sent_at), default=0)
    if ranks[0] < floor:
        problems.append(
            f"{name}: sent after {order[floor]} was published everywhere, yet its first span is {versions[0]}"
        )
    # A version no engine was asked to take before the answer came back cannot label it.
    ceiling = max((i + 1 for i, p in enumerate(published) if p.asked_at <= record.answered_at), default=0)
    if ranks[-1] > ceiling:
        problems.append(f"{name}: its last span is {versions[-1]}, not yet asked for when it was answered")
    if meta.get("weight_version") != versions[-1]:
        problems.append(
            f"{name}: weight_version {meta.get('weight_version')} is not its last span's {versions[-1]}"
        )
    return problems


def rid_of_private_id(private_id: str) -> str:
    """The client's rid in the id a sidecar gave the engine (``<20 hex>-<public id>``)."""
    return private_id.split("-", 1)[1] if "-" in private_id else private_id


def legs_by_rid(received: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """For each client rid, the engine of each request that reached an engine for it (one per
    leg: a resumed generation has several). ``received``: each engine's received private ids."""
    legs: dict[str, list[str]] = {}
    for engine, private_ids in received.items():
        for private_id in private_ids:
            legs.setdefault(rid_of_private_id(private_id), []).append(engine)
    return legs


def session_problems(records: Sequence[TurnRecord], legs: Mapping[str, Sequence[str]]) -> list[str]:
    """Sessions whose requests (every leg of every turn) reached more than one engine, and turns
    no engine received."""
    problems: list[str] = []
    engines_of: dict[str, set[str]] = {}
    for record in records:
        reached = legs.get(record.rid, [])
        if not reached:
            problems.append(f"{record.rid}: no engine received it")
        engines_of.setdefault(record.session, set()).update(reached)
    for session, engines in sorted(engines_of.items()):
        if len(engines) > 1:
            # Each turn's engines, by the end of their URL (the port), in turn order.
            turns = [
                f"t{r.turn} " + "+".join(sorted({e.rsplit(":", 1)[-1] for e in legs.get(r.rid, [])}))
                for r in sorted(records, key=lambda r: r.turn)
                if r.session == session
            ]
            problems.append(f"session {session} went to {len(engines)} engines: {', '.join(turns)}")
    return problems
