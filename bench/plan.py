"""What one benchmark invocation runs: engines, hops, paths and the run matrix."""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from sidecar_common.grpc_core import core_environment

__all__ = [
    "FULL",
    "QUICK",
    "EngineSpec",
    "HopSpec",
    "Profile",
    "available",
    "engine_argv",
    "hop_argv",
]

ENGINE_CORE = 0  # engines and the load generator share this core ...
HOP_CORE = 1  # ... so the hop being measured has the other one to itself.


@dataclass(frozen=True)
class EngineSpec:
    kind: str  # "vllm" | "sglang"
    chunk_tokens: int
    token_latency_ms: float = 0.0

    @property
    def name(self) -> str:
        paced = f"-paced{self.token_latency_ms:g}ms" if self.token_latency_ms else ""
        return f"{self.kind}-K{self.chunk_tokens}{paced}"


@dataclass(frozen=True)
class HopSpec:
    path: str  # the result's path name: bare-proxy, convert-floor, sidecar, sidecar-grpc, sidecar-http
    engine: EngineSpec


@dataclass(frozen=True)
class Profile:
    """How long and how much: --quick fits in a minute, --full takes medians of rounds."""

    name: str
    rounds: int
    warmup_s: float
    window_s: float
    max_tokens: int
    vllm_matrix: tuple[tuple[int, int], ...]  # (K, concurrency)
    sglang_matrix: tuple[tuple[int, int], ...]
    ttft_window_s: float
    paced_window_s: float
    floor: bool = False  # also run bench/convert_floor.py, the converting-hop reference


QUICK = Profile(
    name="quick",
    rounds=1,
    warmup_s=0.4,
    window_s=1.0,
    max_tokens=128,
    vllm_matrix=((1, 1), (1, 16), (1, 256), (8, 256)),
    sglang_matrix=((1, 16),),
    ttft_window_s=1.0,
    paced_window_s=2.0,
)
FULL = Profile(
    name="full",
    rounds=5,
    warmup_s=0.6,
    window_s=2.5,
    max_tokens=128,
    vllm_matrix=((1, 1), (1, 16), (1, 256), (8, 1), (8, 16), (8, 256)),
    sglang_matrix=((1, 1), (1, 16), (1, 256), (8, 16), (8, 256)),
    ttft_window_s=2.0,
    paced_window_s=3.0,
    floor=True,
)

PACED_MS = 20.0
PACED_STREAMS = 16
PACED_MAX_TOKENS = 32
TTFT_MAX_TOKENS = 4


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def available() -> dict[str, bool]:
    """Which pieces of the project exist in this checkout (they land at different times)."""
    return {
        "testkit-vllm": _has("testkit.vllm_engine") and _has("testkit.__main__"),
        "testkit-sglang": _has("testkit.sglang_engine") and _has("testkit.__main__"),
        "sidecar-vllm": _has("sidecar_vllm.__main__") and _has("sidecar_vllm.engine"),
        "sidecar-sglang": _has("sidecar_sglang.__main__") and _has("sidecar_sglang.grpc_transport"),
    }


def _script(name: str) -> str:
    """The console script beside this interpreter (the venv's bin), else the bare name."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def engine_argv(spec: EngineSpec, grpc_addr: str, http_addr: str | None, standin: bool) -> list[str]:
    pace = ["--token-latency-ms", f"{spec.token_latency_ms:g}", "--chunk-tokens", str(spec.chunk_tokens)]
    if spec.kind == "vllm" and standin:
        return [sys.executable, "-m", "bench.standin_engine", "--listen", grpc_addr, *pace]
    if spec.kind == "vllm":
        return [_script("testkit-engine"), "vllm", "--listen", grpc_addr, *pace]
    assert http_addr is not None
    # Incremental streaming: the production setting we recommend (cumulative output makes every
    # HTTP event grow with the sequence, which measures SGLang's choice, not the sidecar).
    return [
        _script("testkit-engine"), "sglang", "--grpc-listen", grpc_addr, "--http-listen", http_addr,
        "--incremental", *pace,
    ]  # fmt: skip


def _as_our_programs_run() -> list[str]:
    """An ``env`` prefix giving a baseline the grpc core settings our programs choose for
    themselves (sidecar_common/grpc_core.py), so that it differs from the sidecar by the
    conversion, not by grpc's TCP client."""
    chosen = core_environment(os.environ)
    return ["env", *(f"{name}={value}" for name, value in chosen.items())] if chosen else []


def hop_argv(hop: HopSpec, listen: str, engine_grpc: str, engine_http: str | None) -> list[str]:
    quiet = ["--log-level", "warning"]
    if hop.path == "bare-proxy":
        return [
            *_as_our_programs_run(), sys.executable, "-m", "bench.bare_proxy",
            "--listen", listen, "--upstream", engine_grpc,
        ]  # fmt: skip
    if hop.path == "convert-floor":
        return [
            *_as_our_programs_run(), sys.executable, "-m", "bench.convert_floor",
            "--listen", listen, "--upstream", engine_grpc,
        ]  # fmt: skip
    if hop.engine.kind == "vllm":
        return [_script("sidecar-vllm"), "--grpc-endpoint", engine_grpc, "--listen", listen, *quiet]
    transport = hop.path.removeprefix("sidecar-")
    assert engine_http is not None
    # Each transport has its own endpoint flag (the CLI refuses the other one).
    if transport == "http":
        dial = ["--http-endpoint", f"http://{engine_http}"]
    else:
        dial = ["--grpc-endpoint", engine_grpc]
    return [
        _script("sidecar-sglang"), "--transport", transport, *dial, "--listen", listen, *quiet,
    ]  # fmt: skip
