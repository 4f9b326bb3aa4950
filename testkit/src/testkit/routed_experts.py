"""A deterministic stand-in for a mixture-of-experts model's routing (pure).

SGLang 0.5.23 returns, for a request with ``return_routed_experts`` on a server started with
``--enable-return-routed-experts``, the experts each MoE layer routed each position to
(``sglang/srt/state_capturer/routed_experts.py``, ``managers/scheduler_components/
batch_result_processor.py`` ``_maybe_collect_routed_experts``): an int32 array of shape
``(positions, layers, top_k)`` over the sequence positions ``[routed_experts_start_len,
seqlen - 1)`` (prompt then output; the last token is never run through the model), native
byte order (little-endian on the hosts SGLang runs on), base64-encoded into
``meta_info["routed_experts"]`` of the final output.

The testkit model has no experts, so the routing is a fake with the real shape: the experts
of layer ``l`` at position ``p`` holding token ``t`` are the first ``top_k`` distinct values of
a splitmix64 chain seeded by ``(p, t, l)``, taken modulo ``num_experts``
(:func:`experts_at`). A pure function of position and token id: the same sequence gives the
same rows whatever the request, and a continuation's rows extend its prefix's.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "ExpertsShape",
    "decode_routed_experts",
    "encode_routed_experts",
    "experts_at",
    "routed_experts",
]

_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread pure hash of a 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass(frozen=True)
class ExpertsShape:
    """The fake model's MoE: ``num_layers`` layers, each routing a token to ``top_k`` of
    ``num_experts`` experts (SGLang's ``num_hidden_layers``, ``num_experts_per_tok``)."""

    num_layers: int = 2
    top_k: int = 2
    num_experts: int = 8

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.top_k < 1:
            raise ValueError("num_layers and top_k must be >= 1")
        if self.num_experts < self.top_k:
            raise ValueError("num_experts must be >= top_k")
        if self.num_experts > 2**31 - 1:
            raise ValueError("expert ids must fit an int32")


def experts_at(position: int, token_id: int, layer: int, shape: ExpertsShape) -> tuple[int, ...]:
    """The ``top_k`` distinct experts ``layer`` routes ``token_id`` at ``position`` to."""
    h = _mix(_mix(_mix(position & _MASK64) ^ (token_id & _MASK64)) ^ layer)
    picked: list[int] = []
    while len(picked) < shape.top_k:
        expert = h % shape.num_experts
        if expert not in picked:
            picked.append(expert)
        h = _mix(h)
    return tuple(picked)


def routed_experts(
    tokens: Sequence[int], start_len: int, shape: ExpertsShape, run_from: int = 0
) -> list[list[list[int]]]:
    """The rows SGLang reports for a sequence (prompt then output): one per position in
    ``[start_len, len(tokens) - 1)``, each ``num_layers`` lists of ``top_k`` experts.

    ``run_from``: the first position this engine ran through the model. A decode server in
    prefill/decode disaggregation receives the prompt's KV cache and never runs the prompt, so
    its capture buffer holds nothing for those positions: SGLang reads them from a host buffer
    it zeroes at start (``state_capturer/base.py`` ``BaseHostCache``), and so rows before
    ``run_from`` are zeros here (on a real server that served before, stale rows)."""
    start = min(max(0, start_len), max(0, len(tokens) - 1))
    unrun = [[0] * shape.top_k for _ in range(shape.num_layers)]
    return [
        [list(row) for row in unrun]
        if p < run_from
        else [list(experts_at(p, tokens[p], layer, shape)) for layer in range(shape.num_layers)]
        for p in range(start, len(tokens) - 1)
    ]


def encode_routed_experts(rows: Sequence[Sequence[Sequence[int]]]) -> str:
    """SGLang's wire form: the int32 array's bytes (little-endian), base64 with padding."""
    flat = [e for row in rows for layer in row for e in layer]
    return base64.b64encode(struct.pack(f"<{len(flat)}i", *flat)).decode("ascii")


def decode_routed_experts(text: str, shape: ExpertsShape) -> list[list[list[int]]]:
    """The rows back from :func:`encode_routed_experts` (what a trainer does with numpy)."""
    raw = base64.b64decode(text)
    flat = list(struct.unpack(f"<{len(raw) // 4}i", raw))
    width = shape.num_layers * shape.top_k
    if len(raw) % 4 or len(flat) % width:
        raise ValueError(f"{len(raw)} bytes are not whole ({shape.num_layers}, {shape.top_k}) rows")
    return [
        [flat[r + layer * shape.top_k : r + (layer + 1) * shape.top_k] for layer in range(shape.num_layers)]
        for r in range(0, len(flat), width)
    ]
