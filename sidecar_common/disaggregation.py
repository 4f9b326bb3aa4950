"""The role of a worker in disaggregated serving, named once for every program.

A sidecar serves one role (its ``--disaggregation-mode``, reported in
``ModelInfo.disaggregation_mode``); the frontend gives each worker a role (``--worker
ROLE=HOST:PORT``, the etcd record's ``role``) and checks that the two agree. Both sides read
the same literal from here. A leaf module (typing only), so pure conversion can name the
type without importing anything else.
"""

from __future__ import annotations

from typing import Final, Literal, TypeGuard, get_args

__all__ = ["ROLES", "DisaggregationMode", "Role", "is_role"]

Role = Literal["agg", "prefill", "decode"]
ROLES: Final[tuple[Role, ...]] = get_args(Role)

# The sidecar's name for its role (the --disaggregation-mode flag): the same values.
DisaggregationMode = Role


def is_role(value: object) -> TypeGuard[Role]:
    return value in ROLES
