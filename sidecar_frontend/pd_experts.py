"""Routed experts of a disaggregated (prefill -> decode) SGLang generation, joined (pure).

SGLang 0.5.23 returns a request's routed experts over the sequence positions
``[routed_experts_start_len, seqlen - 1)``, ``seqlen`` being prompt plus output
(``managers/scheduler_components/batch_result_processor.py`` ``_maybe_collect_routed_experts``):
the rows of the positions this server ran through the model, read by KV slot from a capture
buffer. In prefill/decode disaggregation each server sees only its part:

* the **prefill** server runs the prompt and samples the first token; once the KV transfer is
  done it collects the rows ``[start, prompt)`` (its ``seqlen`` is prompt + 1,
  ``disaggregation/prefill.py``) and answers them on its own final output;
* the **decode** server receives the prompt's KV cache and never runs the prompt, so its rows
  for prompt positions are whatever its buffer held for those slots (zeros on a fresh server,
  another request's rows later; SGLang moves no routing between the two servers). It runs
  positions ``prompt .. prompt + output - 2``.

SGLang's own PD load balancer (``sglang_router/mini_lb.py`` ``_merge_routed_experts``, also
the gateway Miles uses) sends both legs the same start and splices the prefill's bytes over
the decode's first ones. The frontend asks the decode leg from the prompt's end instead
(:func:`decode_start`, within SGLang's rule ``start <= prompt``), so the decode answers only the
rows it ran and none of the meaningless ones travel; the two parts then concatenate into the
rows one aggregated server answers for the same request (:func:`join`).

Nothing here trusts the legs: the parts must be whole rows of one width for the row counts
the request and the decode's output imply (:class:`Mismatch` otherwise), and a part a leg did
not return (its engine started without ``--enable-return-routed-experts``) leaves the answer
without routed experts rather than with half of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from sidecar_common.api import sidecar_pb2

__all__ = [
    "LegExperts",
    "Mismatch",
    "decode_start",
    "join",
    "output_rows",
    "prompt_rows",
]

_INT32: Final = 4


@dataclass(frozen=True)
class Mismatch:
    """The two legs' rows do not line up (different widths, or a count that is not the
    positions the leg ran): no exact answer can be made of them."""

    detail: str


def decode_start(prompt_tokens: int, start_len: int) -> int:
    """The ``routed_experts_start_len`` the decode leg is asked with: the prompt's end (its
    rows before are not meaningful), or the client's start if that is later (then SGLang's
    prefill server refuses it, as an aggregated one would)."""
    return max(prompt_tokens, start_len)


def prompt_rows(prompt_tokens: int, start_len: int) -> int:
    """How many rows the prefill leg answers: positions ``[start, prompt)`` (SGLang clamps the
    start to ``seqlen - 1``, here the prompt's length)."""
    return prompt_tokens - min(max(0, start_len), prompt_tokens)


def output_rows(output_tokens: int) -> int:
    """How many rows the decode leg answers when asked from the prompt's end: the positions of
    its output tokens but the last (never run through the model)."""
    return max(0, output_tokens - 1)


def _width(part: bytes, rows: int, leg: str) -> int | Mismatch | None:
    """The bytes per row of one leg's part (None: no rows to tell)."""
    if rows == 0:
        if part:
            return Mismatch(f"the {leg} leg answered {len(part)} bytes of routed experts for no positions")
        return None
    if len(part) % rows or (len(part) // rows) % _INT32 or not part:
        return Mismatch(
            f"the {leg} leg answered {len(part)} bytes of routed experts, "
            f"not whole int32 rows for its {rows} positions"
        )
    return len(part) // rows


def join(
    prefill: bytes | None, decode: bytes | None, *, prompt_rows: int, output_rows: int
) -> bytes | Mismatch | None:
    """The routed experts of the whole generation: the prefill leg's rows (``prompt_rows`` of
    them) then the decode leg's (``output_rows``), as one aggregated server answers them.

    None when a leg that has rows to answer returned none: the rows could not be exact.
    A leg with no rows to answer may return none (or ``b""``, as SGLang does)."""
    if prefill is None and prompt_rows == 0:
        prefill = b""
    if decode is None and output_rows == 0:
        decode = b""
    if prefill is None or decode is None:
        return None
    widths: list[int] = []
    for part, rows, leg in ((prefill, prompt_rows, "prefill"), (decode, output_rows, "decode")):
        width = _width(part, rows, leg)
        if isinstance(width, Mismatch):
            return width
        if width is not None:
            widths.append(width)
    if len(set(widths)) > 1:
        return Mismatch(
            f"the prefill leg's routed-experts rows are {widths[0]} bytes wide, "
            f"the decode leg's {widths[1]}: the two engines route differently shaped models"
        )
    return prefill + decode


@dataclass
class LegExperts:
    """One disaggregated attempt's routed experts: the prefill leg's part as its outputs come,
    joined into the decode leg's terminal (in place). ``prompt_tokens`` and ``start_len`` are
    the attempt's request's (its prompt holds every token a migration delivered before)."""

    prompt_tokens: int
    start_len: int
    prefill: bytes | None = None
    decode_tokens: int = 0

    def from_prefill(self, output: sidecar_pb2.LLMEngineOutput) -> None:
        if output.HasField("routed_experts"):
            self.prefill = output.routed_experts

    def needs_prefill(self, output: sidecar_pb2.LLMEngineOutput) -> bool:
        """Whether joining ``output`` (a decode output) waits for the prefill leg's end: a
        terminal that carries routed experts (without them there is no exact answer anyway)."""
        return output.finish_reason != sidecar_pb2.UNSPECIFIED and output.HasField("routed_experts")

    def into_decode(self, output: sidecar_pb2.LLMEngineOutput) -> Mismatch | None:
        """Count a decode output's tokens; on its terminal, replace its routed experts with the
        whole generation's (absent when they cannot be exact)."""
        self.decode_tokens += len(output.token_ids)
        if output.finish_reason == sidecar_pb2.UNSPECIFIED:
            return None
        joined = join(
            self.prefill,
            output.routed_experts if output.HasField("routed_experts") else None,
            prompt_rows=prompt_rows(self.prompt_tokens, self.start_len),
            output_rows=output_rows(self.decode_tokens),
        )
        if isinstance(joined, Mismatch):
            return joined
        if joined is None:
            output.ClearField("routed_experts")
        else:
            output.routed_experts = joined
        return None
