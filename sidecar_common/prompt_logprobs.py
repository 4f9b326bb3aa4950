"""Prompt logprobs on the sidecar.v1 wire (pure): the one owner of their shapes.

``LLMEngineOutput.prompt_logprobs`` has one ``TopLogprobs`` per prompt position: the prompt
token's entry first (with its rank when the engine reports one), then the alternatives; no
entries where the engine has none. Sidecars of 0.1 sent them in ``engine_data`` instead, one
item per position, null where there are none, each sidecar in its own shape:

* :attr:`Shape.BY_TOKEN` (the vLLM sidecar): ``{"<token id>": {"logprob": x, "rank": r}}``,
  the rank only where it is known; a Struct keeps no key order.
* :attr:`Shape.LISTED` (the SGLang sidecar): ``[{"token_id": id, "logprob": x}, ...]``, the
  prompt token first, no ranks.

Through 0.2.x each sidecar writes the typed field and its Struct shape (:func:`attach`), and
the frontend reads the typed field, else either Struct shape (:func:`of_output`); docs/api.md,
"Struct shapes kept for one release".
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from typing import Final

from sidecar_common.api import sidecar_pb2
from sidecar_common.structs import JSON, StructError, json_from_value

__all__ = [
    "STRUCT_KEY",
    "Shape",
    "attach",
    "candidate",
    "carried",
    "from_struct_rows",
    "of_output",
    "to_struct_rows",
    "truncate",
]

STRUCT_KEY: Final = "prompt_logprobs"
_UINT32_MAX: Final = 2**32 - 1


class Shape(enum.Enum):
    """The 0.1 Struct shape of one sidecar's prompt logprobs."""

    BY_TOKEN = "by_token"
    LISTED = "listed"


def candidate(token_id: int, logprob: float, rank: int | None = None) -> sidecar_pb2.TopLogprob:
    """One entry of a position, as the sidecars write it. A negative zero is written as zero:
    a 0.1 Struct gave it back as the integer 0, and both forms must read the same."""
    entry = sidecar_pb2.TopLogprob(token_id=token_id, logprob=logprob + 0.0)
    if rank is not None:
        entry.rank = rank
    return entry


def to_struct_rows(positions: Iterable[sidecar_pb2.TopLogprobs], shape: Shape) -> list[JSON]:
    """The positions in a 0.1 Struct shape (values as they are: the caller keeps them finite)."""
    rows: list[JSON] = []
    for position in positions:
        if not position.entries:
            rows.append(None)
        elif shape is Shape.BY_TOKEN:
            by_token: dict[str, JSON] = {}
            for entry in position.entries:
                candidate: dict[str, JSON] = {"logprob": entry.logprob}
                if entry.HasField("rank"):
                    candidate["rank"] = entry.rank
                by_token.setdefault(str(entry.token_id), candidate)
            rows.append(by_token)
        else:
            rows.append([{"token_id": e.token_id, "logprob": e.logprob} for e in position.entries])
    return rows


def attach(
    out: sidecar_pb2.LLMEngineOutput, positions: Sequence[sidecar_pb2.TopLogprobs], shape: Shape
) -> None:
    """Put a choice's prompt logprobs on ``out``: the typed field, and for 0.1 frontends the
    Struct in ``shape`` (through 0.2.x)."""
    out.prompt_logprobs.extend(positions)
    # Struct.update, not the strict structs.value_from_json: a sidecar that let a non-finite
    # logprob through wrote it this way in 0.1 too.
    out.engine_data.update({STRUCT_KEY: to_struct_rows(positions, shape)})


def from_struct_rows(rows: JSON, prompt: Sequence[int] = ()) -> list[sidecar_pb2.TopLogprobs] | None:
    """The positions of a 0.1 Struct, in either shape; None when ``rows`` is not a list.

    A position that is neither shape has no entries. A candidate without a token id that
    fits a uint32 is left out; one without a numeric logprob reads as NaN (none given), a rank
    that is not a uint32 as absent. ``prompt``, when given, puts each position's prompt token
    first (a by-token position has no order of its own).
    """
    if not isinstance(rows, list):
        return None
    positions: list[sidecar_pb2.TopLogprobs] = []
    for index, row in enumerate(rows):
        entries = _entries(row)
        if index < len(prompt):
            own = prompt[index]
            entries.sort(key=lambda entry: entry.token_id != own)  # stable: the rest keep their order
        positions.append(sidecar_pb2.TopLogprobs(entries=entries))
    return positions


def _entries(row: JSON) -> list[sidecar_pb2.TopLogprob]:
    if isinstance(row, dict):
        keyed = ((_token_id_text(key), item) for key, item in row.items())
        return [_entry(token, item) for token, item in keyed if token is not None and isinstance(item, dict)]
    if isinstance(row, list):
        return [
            _entry(token, item)
            for item in row
            if isinstance(item, dict) and (token := _token_id(item.get("token_id"))) is not None
        ]
    return []


def _entry(token: int, fields: dict[str, JSON]) -> sidecar_pb2.TopLogprob:
    logprob, rank = fields.get("logprob"), fields.get("rank")
    entry = sidecar_pb2.TopLogprob(token_id=token, logprob=_number(logprob))
    if (ranked := _token_id(rank)) is not None:
        entry.rank = ranked
    return entry


def _number(value: JSON) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return math.nan


def _token_id(value: JSON) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _UINT32_MAX:
        return value
    return None


def _token_id_text(key: str) -> int | None:
    return _token_id(int(key)) if key.isascii() and key.isdecimal() else None


def carried(output: sidecar_pb2.LLMEngineOutput) -> bool:
    """Whether ``output`` carries prompt logprobs, in either form (even an unreadable Struct)."""
    return bool(output.prompt_logprobs) or (
        output.HasField("engine_data") and STRUCT_KEY in output.engine_data.fields
    )


def of_output(
    output: sidecar_pb2.LLMEngineOutput, prompt: Sequence[int] = ()
) -> Sequence[sidecar_pb2.TopLogprobs] | None:
    """The prompt logprobs ``output`` carries: the typed field, else (a 0.1 sidecar) the
    Struct's; None when it carries none or a Struct that is not a list of positions."""
    if output.prompt_logprobs:
        return output.prompt_logprobs
    if not output.HasField("engine_data"):
        return None
    value = output.engine_data.fields.get(STRUCT_KEY)
    if value is None:
        return None
    try:
        rows = json_from_value(value, STRUCT_KEY)
    except StructError:
        return None
    return from_struct_rows(rows, prompt)


def truncate(output: sidecar_pb2.LLMEngineOutput, length: int) -> None:
    """Keep the first ``length`` positions, in both forms (a continuation's prompt is longer
    than the one the client asked about)."""
    del output.prompt_logprobs[length:]
    if output.HasField("engine_data") and STRUCT_KEY in output.engine_data.fields:
        del output.engine_data.fields[STRUCT_KEY].list_value.values[length:]
