"""Start-up discovery for SGLang (pure): server info, model info and the model list (JSON, as
either transport returns them) -> ``ModelInfo`` and the settings request and response
conversion depend on. Numbers may arrive as JSON numbers or as strings.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sidecar_common.api import sidecar_pb2
from sidecar_common.disaggregation import DisaggregationMode
from sidecar_common.endpoint import is_wildcard_host
from sidecar_common.errors import FailureReason, SidecarError, protocol_error
from sidecar_common.limits import exact_integer
from sidecar_sglang.convert_request import RequestSettings, Transport

__all__ = ["Discovered", "discover", "loads_from_json"]


@dataclass(frozen=True)
class Discovered:
    model_info: sidecar_pb2.ModelInfo
    settings: RequestSettings
    incremental: bool


def _int(value: object) -> int | None:
    # The one rule for integers in JSON, shared with the prefill handoff's.
    return exact_integer(value)


def _bool(value: object) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)


def _str(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _nonneg(value: int | None) -> int:
    return value if value is not None and value > 0 else 0


def _mode(value: object) -> DisaggregationMode:
    text = str(value).strip().lower() if value is not None else "null"
    if text in ("null", "none", ""):
        return "agg"
    if text in ("prefill", "decode"):
        return "prefill" if text == "prefill" else "decode"
    raise protocol_error("sglang", f"unknown disaggregation_mode {value!r}")


def _card(models: Sequence[Mapping[str, object]], served: str | None) -> Mapping[str, object] | None:
    for card in models:
        if served is not None and card.get("id") == served:
            return card
    for card in models:
        if not card.get("parent"):
            return card
    return None


def _context_length(card: Mapping[str, object] | None, server: Mapping[str, object]) -> int:
    # The card's max_model_len is the model's real context; server info's context_length is
    # only the launch flag (often null), and max_req_input_len is one less than the context.
    from_card = _int(card.get("max_model_len")) if card is not None else None
    if from_card:
        return from_card
    max_input = _int(server.get("max_req_input_len"))
    if max_input:
        return max_input + 1
    return _nonneg(_int(server.get("context_length")))


def _max_running(server: Mapping[str, object]) -> int:
    direct = _int(server.get("max_running_requests"))
    if direct:
        return direct
    states = server.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], dict):
        return _nonneg(_int(states[0].get("max_running_requests")))
    return 0


def discover(
    model: Mapping[str, object],
    server: Mapping[str, object],
    models: Sequence[Mapping[str, object]],
    *,
    expected_mode: DisaggregationMode,
    transport: Transport,
    engine_host: str,
) -> Discovered:
    """Raises SidecarError(INVALID_ARGUMENT) when the engine's disaggregation mode disagrees
    with ``--disaggregation-mode`` (a start-up error, the sidecar must not serve)."""
    served = _str(model.get("served_model_name")) or _str(server.get("served_model_name"))
    card = _card(models, served)
    if served is None and card is not None:
        served = _str(card.get("id"))
    mode = _mode(model.get("disaggregation_mode", server.get("disaggregation_mode")))
    if "disaggregation_mode" in server:
        mode = _mode(server.get("disaggregation_mode"))
    if mode != expected_mode:
        # A configuration error, not a connectivity one: retrying elsewhere would not help.
        raise SidecarError(
            FailureReason.INVALID_ARGUMENT,
            f"--disaggregation-mode is {expected_mode} but the SGLang engine runs {mode}",
        )
    page = _nonneg(_int(server.get("page_size")))
    total_tokens = _nonneg(_int(server.get("max_total_num_tokens")))
    host = _str(server.get("disaggregation_bootstrap_host")) or _str(server.get("host"))
    if host is None or is_wildcard_host(host):
        # The engine listens on every interface: the address the sidecar reaches it by is the
        # one a decode worker can use too.
        host = engine_host
    bootstrap_port = _int(server.get("disaggregation_bootstrap_port"))
    info = sidecar_pb2.ModelInfo(
        engine="sglang",
        served_model_name=served or "",
        model_path=_str(model.get("model_path")) or _str(server.get("model_path")) or "",
        tokenizer_path=_str(model.get("tokenizer_path")) or _str(server.get("tokenizer_path")) or "",
        max_context_length=_context_length(card, server),
        kv_block_size=page,
        total_kv_blocks=total_tokens // page if page else 0,
        max_num_seqs=_max_running(server),
        data_parallel_size=_nonneg(_int(server.get("dp_size"))),
        disaggregation_mode=mode,
        # Media is refused over gRPC (SGLang's gRPC server may drop it silently), so only the
        # HTTP transport can claim vision.
        supports_vision=transport == "http" and _bool(model.get("has_image_understanding", False)),
        engine_version=_str(server.get("version")) or "",
    )
    settings = RequestSettings(
        mode=mode,
        transport=transport,
        bootstrap_host=host if mode != "agg" else None,
        bootstrap_port=bootstrap_port if mode != "agg" else None,
        low_priority_values_first=_bool(server.get("schedule_low_priority_values_first", False)),
        # Refused by name here what SGLang would refuse with a bare INTERNAL over gRPC.
        dp_size=_nonneg(_int(server.get("dp_size"))) or None,
        context_length=(
            None if _bool(server.get("allow_auto_truncate", False)) else info.max_context_length or None
        ),
        # SGLang reports its resolved --enable-lora: null (not given) and false both mean off.
        lora_enabled=_bool(server.get("enable_lora")) if "enable_lora" in server else None,
    )
    return Discovered(info, settings, _bool(server.get("incremental_streaming_output", False)))


def _find(entry: Mapping[str, object], key: str) -> object:
    """A load figure at the top level or inside one of the sections (core, memory, ...)."""
    if key in entry:
        return entry[key]
    for value in entry.values():
        if isinstance(value, dict) and key in value:
            return value[key]
    return None


def loads_from_json(payload: object) -> tuple[sidecar_pb2.RankLoad, ...]:
    """``/v1/loads`` (``{"loads": [...]}``) or gRPC GetLoad (a list) -> per-rank loads."""
    entries = payload.get("loads") if isinstance(payload, dict) else payload
    if not isinstance(entries, list):
        return ()
    ranks: list[sidecar_pb2.RankLoad] = []
    for position, entry in enumerate(entries):
        if not isinstance(entry, dict):
            continue
        dp_rank = _int(_find(entry, "dp_rank"))
        rank = sidecar_pb2.RankLoad(dp_rank=dp_rank if dp_rank is not None and dp_rank >= 0 else position)
        running = _int(_find(entry, "num_running_reqs"))
        waiting = _int(_find(entry, "num_waiting_reqs"))
        usage = _find(entry, "token_usage")
        if running is not None and running >= 0:
            rank.running_requests = running
        if waiting is not None and waiting >= 0:
            rank.waiting_requests = waiting
        if isinstance(usage, int | float | str) and not isinstance(usage, bool):
            with contextlib.suppress(ValueError):
                rank.kv_usage = min(max(float(usage), 0.0), 1.0)
        ranks.append(rank)
    return tuple(ranks)
