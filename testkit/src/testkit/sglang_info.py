"""What the testkit SGLang engine is and reports (pure): its configuration, and the JSON its
info endpoints serve on both wires (server info, model info, per-rank load).

The keys and shapes follow SGLang 0.5.23's ``get_server_info`` / ``get_model_info`` /
``/v1/loads`` and its gRPC counterparts, which differ in a few keys (noted where they do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from testkit.book import Book
from testkit.kv_events import KvEventsConfig
from testkit.routed_experts import ExpertsShape
from testkit.sglang_core import SGLANG_VERSION
from testkit.weight_versions import DEFAULT_WEIGHT_VERSION

__all__ = ["DISAGG_MODES", "SglangEngineConfig", "loads", "model_info", "server_info"]

DISAGG_MODES = ("null", "prefill", "decode")


@dataclass(frozen=True)
class SglangEngineConfig:
    grpc_host: str = "127.0.0.1"
    grpc_port: int | None = 0  # None: do not serve gRPC
    http_host: str = "127.0.0.1"
    http_port: int | None = 0  # None: do not serve HTTP
    incremental: bool = False
    model_path: str = "testkit/tiny-sglang"
    served_model_name: str | None = None  # None: the model path, as SGLang does
    eos_token_id: int = 2
    vocab_size: int = 32000
    context_length: int = 4096
    # SGLang's server info reports the --context-length launch flag, null when not given.
    context_length_flag: int | None = None
    kv_capacity_tokens: int = 1 << 20  # max_total_num_tokens
    page_size: int = 1
    max_running_requests: int = 256
    # SGLang's --enable-lora (None: not given). Off, a request naming an adapter is refused in
    # SGLang's words (gRPC INTERNAL, HTTP 400).
    enable_lora: bool | None = None
    # SGLang's --lora-paths, by adapter name: the adapters loaded at start (given alone, they
    # turn LoRA on, as SGLang resolves an unset --enable-lora). With LoRA on, these are served
    # (as if loaded) and any other name is refused in SGLang's words, as one never loaded.
    lora_paths: tuple[str, ...] = ()
    # SGLang's --max-queued-requests: a request that must wait while this many already wait is
    # aborted with status 503 ("The request queue is full."). None: unbounded.
    max_queued_requests: int | None = None
    dp_size: int = 1
    token_latency_ms: float = 0.0
    # Each running request beyond the first adds this to every decode step (see
    # testkit.pacing): the more requests run, the slower each streams. 0: a flat step.
    token_latency_slope_ms: float = 0.0
    chunk_tokens: int = 1  # SGLang's --stream-interval
    startup_delay_secs: float = 0.0
    disaggregation_mode: str = "null"
    bootstrap_port: int = 8998
    # SGLang aborts a request whose HTTP client left ~2 s later (a background task).
    disconnect_abort_delay_secs: float = 2.0
    # With one tokenizer worker SGLang ignores an HTTP abort whose rid names no live request
    # (so a bare prefix aborts nothing); with more it forwards it and the scheduler matches
    # every rid that starts with it.
    tokenizer_workers: int = 1
    # SGLang's --kv-events-config (None or publisher "null": no events). The prefix cache holds
    # kv_capacity_tokens // page_size pages; a prompt's first token waits prefill_us_per_token
    # for each prompt token not cached (a simulated GPU; testkit only).
    kv_events: KvEventsConfig | None = None
    prefill_us_per_token: float = 0.0
    # SGLang's --weight-version: the version the engine starts with (updates change it).
    weight_version: str = DEFAULT_WEIGHT_VERSION
    # SGLang's --enable-return-routed-experts, and the fake MoE's shape (testkit.routed_experts;
    # SGLang reads num_hidden_layers and num_experts_per_tok from the model's config).
    enable_return_routed_experts: bool = False
    num_hidden_layers: int = 2
    num_experts_per_tok: int = 2
    num_experts: int = 8
    # SGLang's SGLANG_HEALTH_CHECK_TIMEOUT: how long /health and /health_generate wait for
    # their probe's first output (a paused engine gives none) before answering 503.
    health_check_timeout_secs: float = 20.0

    def __post_init__(self) -> None:
        if self.disaggregation_mode not in DISAGG_MODES:
            raise ValueError(f"disaggregation_mode must be one of {DISAGG_MODES}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError("max_queued_requests must be >= 0")
        if self.chunk_tokens < 1 or self.max_running_requests < 1 or self.dp_size < 1:
            raise ValueError("chunk_tokens, max_running_requests and dp_size must be >= 1")
        if self.prefill_us_per_token < 0:
            raise ValueError("prefill_us_per_token must be >= 0")
        if self.token_latency_slope_ms < 0:
            raise ValueError("token_latency_slope_ms must be >= 0")
        if self.token_latency_ms < 0 or self.startup_delay_secs < 0 or self.disconnect_abort_delay_secs < 0:
            raise ValueError("latencies and delays must be >= 0")
        if self.context_length < 2 or self.kv_capacity_tokens < 1 or self.page_size < 1:
            raise ValueError("context_length, kv_capacity_tokens and page_size must be positive")
        if self.health_check_timeout_secs < 0:
            raise ValueError("health_check_timeout_secs must be >= 0")
        ExpertsShape(self.num_hidden_layers, self.num_experts_per_tok, self.num_experts)  # checks the shape

    @property
    def experts_shape(self) -> ExpertsShape:
        return ExpertsShape(self.num_hidden_layers, self.num_experts_per_tok, self.num_experts)

    @property
    def lora_enabled(self) -> bool:
        """LoRA on, as SGLang resolves it: --enable-lora, or --lora-paths without it."""
        return bool(self.enable_lora) or (self.enable_lora is None and bool(self.lora_paths))

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path


def server_info(
    cfg: SglangEngineConfig,
    *,
    http: bool,
    http_port: int,
    grpc_port: int,
    started_at: float,
    kv_events: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``get_server_info`` (HTTP) / ``GetServerInfo`` (gRPC): the keys a sidecar discovers from."""
    info: dict[str, Any] = {
        "model_path": cfg.model_path,
        "tokenizer_path": cfg.model_path,
        "served_model_name": cfg.model_name,
        "skip_tokenizer_init": False,
        "host": cfg.http_host,
        "port": http_port,
        "grpc_port": grpc_port or None,
        "context_length": cfg.context_length_flag,
        "page_size": cfg.page_size,
        "max_running_requests": cfg.max_running_requests,
        "max_total_tokens": None,
        "dp_size": cfg.dp_size,
        # The resolved flag; null when neither flag was given.
        "enable_lora": cfg.lora_enabled if cfg.enable_lora is not None or cfg.lora_paths else None,
        "tp_size": 1,
        "pp_size": 1,
        "stream_interval": cfg.chunk_tokens,
        "incremental_streaming_output": cfg.incremental,
        "tokenizer_worker_num": cfg.tokenizer_workers,
        "disaggregation_mode": cfg.disaggregation_mode,
        "disaggregation_bootstrap_port": cfg.bootstrap_port,
        "device": "cpu",
        "launch_command": "testkit-engine sglang",
        "status": "ready",
        "max_total_num_tokens": cfg.kv_capacity_tokens,
        "max_req_input_len": min(cfg.context_length, cfg.kv_capacity_tokens) - 1,
        # SGLang's descriptor of its KV-event publisher (kv_events.sglang_kv_events_descriptor).
        "kv_events": kv_events,
        "enable_return_routed_experts": cfg.enable_return_routed_experts,
    }
    if http:
        info.update(
            startup_time=started_at,
            internal_states=[{"last_gen_throughput": 0.0}],
            version=SGLANG_VERSION,
            frontend="python",
        )
    else:
        info["grpc_features"] = []
    return info


def model_info(
    cfg: SglangEngineConfig, *, http: bool, weight_version: str, model_path: str | None = None
) -> dict[str, Any]:
    """``/model_info`` / ``GetModelInfo``: ``weight_version`` is the tokenizer manager's; after
    a weight update from disk SGLang reports that update's ``model_path`` as both the model
    path and the served model name (``model_path``; None: none yet)."""
    info: dict[str, Any] = {
        "model_path": model_path or cfg.model_path,
        "served_model_name": model_path or cfg.model_name,
        "tokenizer_path": cfg.model_path,
        "is_generation": True,
        "weight_version": weight_version,
        "load_format": "auto",
        "reasoning_parser": None,
        "tool_call_parser": None,
        "disaggregation_mode": cfg.disaggregation_mode,
        "model_type": "testkit",
        "architectures": ["TestkitForCausalLM"],
    }
    if http:
        info.update(
            preferred_sampling_params=None, has_image_understanding=False, has_audio_understanding=False
        )
    return info


def loads(cfg: SglangEngineConfig, book: Book, dp_rank: int | None, now: float) -> list[dict[str, Any]]:
    """``GetLoad`` / ``/v1/loads``: one row per dp rank (rank 0 does the work)."""
    if dp_rank is not None and not 0 <= dp_rank < cfg.dp_size:
        return []
    used = book.used_tokens()
    total = cfg.kv_capacity_tokens
    running = book.running_count
    waiting_tokens = 0
    rows = []
    for rank in range(cfg.dp_size):
        if dp_rank is not None and rank != dp_rank:
            continue
        mine = rank == 0  # one scheduler does the work; other ranks idle
        rows.append(
            {
                "timestamp": now,
                "dp_rank": rank,
                "num_running_reqs": running if mine else 0,
                "num_waiting_reqs": book.waiting_count if mine else 0,
                "num_waiting_uncached_tokens": waiting_tokens,
                "num_used_tokens": used if mine else 0,
                "num_total_tokens": used if mine else 0,
                "num_active_tokens": used if mine else 0,
                "num_prealloc_ready_tokens": 0,
                "max_total_num_tokens": total,
                "max_running_requests": cfg.max_running_requests,
                "token_usage": round(used / total, 4) if mine else 0.0,
                "gen_throughput": 0.0,
                "cache_hit_rate": 0.0,
                "utilization": round(running / cfg.max_running_requests, 4) if mine else 0.0,
                "total_prefill_uncached_tokens": 0,
                "total_prefill_busy_us": 0,
                "decode_moments": None,
            }
        )
    return rows
