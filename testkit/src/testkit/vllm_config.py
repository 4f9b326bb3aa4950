"""The testkit vLLM engine's settings: plain data, so that ``testkit-engine vllm --help``
and its usage errors import no grpc; the engine is :mod:`testkit.vllm_engine`."""

from __future__ import annotations

from dataclasses import dataclass

from testkit.generator import ModelSpec
from testkit.kv_events import KvEventsConfig

__all__ = ["VllmEngineConfig"]

_KV_ROLES = ("", "kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class VllmEngineConfig:
    host: str = "127.0.0.1"
    port: int = 0
    served_model_name: str = "testkit-model"
    model_path: str = "testkit/tiny-model"
    context_length: int = 4096
    vocab_size: int = 32000
    eos_token_ids: tuple[int, ...] = (2,)
    kv_role: str = ""
    kv_engine_id: str = "testkit-engine-0"
    kv_host: str = "127.0.0.1"
    kv_port: int = 5600
    data_parallel_size: int = 1
    block_size: int = 16
    max_num_seqs: int = 256
    total_kv_tokens: int = 65536
    token_latency_ms: float = 0.0
    # Each running request beyond the first adds this to every decode step (see
    # testkit.pacing): the more requests run, the slower each streams. 0: a flat step.
    token_latency_slope_ms: float = 0.0
    chunk_tokens: int = 1
    startup_delay_secs: float = 0.0
    supports_vision: bool = False
    # vLLM's --max-logprobs (its default): more logprobs per position are refused.
    max_logprobs: int = 20
    # vLLM's --max-num-queued-reqs and --max-num-queued-tokens (admission control; None: no
    # limit, vLLM's default). See ``VllmTestEngine.admission_refusal``.
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    # The prefix cache: vLLM's --num-gpu-blocks-override (None: total_kv_tokens // block_size
    # blocks) and --kv-events-config (None or publisher "null": no events). A prompt's first
    # token waits prefill_us_per_token for each prompt token not cached (a simulated GPU).
    num_gpu_blocks_override: int | None = None
    kv_events: KvEventsConfig | None = None
    prefill_us_per_token: float = 0.0
    # The admin HTTP port (testkit.vllm_admin: vLLM's /pause, /resume, /is_paused and weight
    # version routes). None: not served; 0: a free port.
    admin_host: str = "127.0.0.1"
    admin_port: int | None = None

    def __post_init__(self) -> None:
        if self.kv_role not in _KV_ROLES:
            raise ValueError(f"kv_role must be one of {_KV_ROLES}")
        if self.chunk_tokens < 1 or self.max_num_seqs < 1 or self.data_parallel_size < 1:
            raise ValueError("chunk_tokens, max_num_seqs and data_parallel_size must be >= 1")
        for limit in (self.max_num_queued_reqs, self.max_num_queued_tokens):
            if limit is not None and limit < 0:
                raise ValueError("max_num_queued_reqs and max_num_queued_tokens must be >= 0")
        if self.block_size < 1 or self.prefill_us_per_token < 0:
            raise ValueError("block_size must be >= 1 and prefill_us_per_token >= 0")
        if self.token_latency_slope_ms < 0:
            raise ValueError("token_latency_slope_ms must be >= 0")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 0:
            raise ValueError("num_gpu_blocks_override must be >= 0")

    @property
    def num_gpu_blocks(self) -> int:
        if self.num_gpu_blocks_override is not None:
            return self.num_gpu_blocks_override
        return self.total_kv_tokens // self.block_size

    @property
    def model(self) -> ModelSpec:
        return ModelSpec(self.vocab_size, self.eos_token_ids, self.context_length)
