"""Who a request is, for admission: its tenant, its urgency, and what it will cost. Pure.

The tenant is one header's value (by default ``x-gateway-inference-fairness-id``, the Gateway
API Inference Extension's fairness header); a request without it belongs to the default tenant
(""). A gateway in front of the frontend should strip the header from its clients' requests and
set it from their authentication: the frontend believes whatever the header says.

Urgency is one integer ordering the admission queue's bands, larger first. Each format's own
``priority`` field keeps its server's meaning:

- vLLM's ``/inference/v1/generate``: a *lower* value is served first (vLLM's priority
  scheduling); the format already stores it negated in ``routing.priority``, so the urgency is
  that field as it stands.
- SGLang's ``/generate``: a *larger* value is served first, unless the frontend is told
  ``--sglang-low-priority-values-first`` (SGLang's own server flag of that name); the format
  stores the value as given.

A priority header (``--priority-header``) overrides the body's field, read in the same format's
meaning. An absent priority is urgency 0 (both servers' default priority).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from sidecar_common.api import sidecar_pb2

__all__ = [
    "DEFAULT_OUTPUT_ESTIMATE",
    "DEFAULT_PRIORITY_HEADER",
    "DEFAULT_TENANT",
    "DEFAULT_TENANT_HEADER",
    "MAX_TENANT_CHARS",
    "Who",
    "WhoRules",
    "estimated_tokens",
    "read_who",
    "sequences",
]

DEFAULT_TENANT_HEADER: Final = "x-gateway-inference-fairness-id"
DEFAULT_PRIORITY_HEADER: Final = "x-sidecar-priority"
DEFAULT_TENANT: Final = ""
# A tenant name longer than this is refused: the name is a key of the queue and of the rate
# limits, and a label of the metrics.
MAX_TENANT_CHARS: Final = 256
# What a request that sets no output budget is assumed to generate, for its fair-share and rate
# cost before it ran (SGLang's own default max_new_tokens is 128; the real usage is settled after).
DEFAULT_OUTPUT_ESTIMATE: Final = 256
_INT64: Final = 2**63


@dataclass(frozen=True)
class WhoRules:
    """How to read a request's tenant and priority (the frontend's flags)."""

    tenant_header: str = DEFAULT_TENANT_HEADER
    priority_header: str = DEFAULT_PRIORITY_HEADER
    sglang_low_priority_values_first: bool = False


@dataclass(frozen=True)
class Who:
    tenant: str
    urgency: int  # larger first


def _header(headers: Mapping[str, str], name: str) -> str | None:
    wanted = name.lower()
    for key, value in headers.items():
        if key.lower() == wanted:
            return value
    return None


def read_who(
    format_name: str,
    headers: Mapping[str, str],
    requests: Sequence[sidecar_pb2.PreprocessedRequest],
    rules: WhoRules,
) -> Who | tuple[str, str]:
    """The request's tenant and urgency, or (the field, what is wrong with it) for a 400."""
    tenant = (_header(headers, rules.tenant_header) or "").strip()
    if len(tenant) > MAX_TENANT_CHARS:
        return rules.tenant_header, f"it must be at most {MAX_TENANT_CHARS} characters, got {len(tenant)}"
    low_first = format_name == "sglang" and rules.sglang_low_priority_values_first
    given = _header(headers, rules.priority_header)
    if given is not None:
        try:
            value = int(given.strip())
        except ValueError:
            return rules.priority_header, f"it must be an integer, got {given!r}"
        if not -_INT64 <= value < _INT64:
            return rules.priority_header, "it must be a signed 64-bit integer"
        # The header speaks the format's own language, as its body field does.
        urgency = -value if format_name == "vllm" or low_first else value
        return Who(tenant, urgency)
    # Every sub-request of one HTTP request carries the same priority: read the first.
    first = requests[0] if requests else None
    if first is None or not first.routing.HasField("priority"):
        return Who(tenant, 0)
    stored = first.routing.priority
    return Who(tenant, -stored if low_first else stored)


def sequences(
    requests: Sequence[sidecar_pb2.PreprocessedRequest],
) -> int:
    """The sequences a request runs at once on its engines (each sub-request's ``n``): the
    slots it takes of the fleet's ``max_num_seqs``."""
    total = 0
    for request in requests:
        options = request.sampling_options
        total += max(options.n, 1) if options.HasField("n") else 1
    return max(total, 1)


def estimated_tokens(
    requests: Sequence[sidecar_pb2.PreprocessedRequest],
) -> int:
    """Prompt plus output budget of every sequence: what the request is charged before it ran
    (its fair share and its tokens per minute), settled on the real usage once it ended."""
    total = 0
    for request in requests:
        options = request.sampling_options
        n = max(options.n, 1) if options.HasField("n") else 1
        stop = request.stop_conditions
        budget = stop.max_tokens if stop.HasField("max_tokens") else DEFAULT_OUTPUT_ESTIMATE
        total += len(request.token_ids) + n * budget
    return max(total, 1)
