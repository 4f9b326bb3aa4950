"""``testkit-engine sglang ...``: the flags, and serving one engine until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys

from testkit.cli_args import fault_arg, optional_listen_arg
from testkit.faults import FaultPlan
from testkit.sglang_engine import SglangTestEngine
from testkit.sglang_info import DISAGG_MODES, SglangEngineConfig

__all__ = ["add_arguments", "config_from_args", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``testkit-engine sglang``."""
    d = SglangEngineConfig()
    a = parser.add_argument
    a("--grpc-listen", type=optional_listen_arg, default=("127.0.0.1", 30001), help="HOST:PORT or 'off'")
    a("--http-listen", type=optional_listen_arg, default=("127.0.0.1", 30000), help="HOST:PORT or 'off'")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--incremental", dest="incremental", action="store_true", default=False,
                      help="stream deltas (SGLang's --incremental-streaming-output)")  # fmt: skip
    mode.add_argument("--cumulative", dest="incremental", action="store_false",
                      help="stream cumulative output_ids and text (SGLang's default)")  # fmt: skip
    a("--model-path", default=d.model_path)
    a("--served-model-name", default=None, help="default: the model path")
    a("--eos-token-id", type=int, default=d.eos_token_id)
    a("--vocab-size", type=int, default=d.vocab_size)
    a("--context-length", type=int, default=None,
      help=f"default {d.context_length}; server info reports it only when given")  # fmt: skip
    a("--kv-capacity-tokens", type=int, default=d.kv_capacity_tokens, help="max_total_num_tokens")
    a("--page-size", type=int, default=d.page_size)
    a("--max-running-requests", type=int, default=d.max_running_requests)
    a("--max-queued-requests", type=int, default=d.max_queued_requests)
    a("--dp-size", type=int, default=d.dp_size)
    a("--token-latency-ms", type=float, default=d.token_latency_ms)
    a("--chunk-tokens", type=int, default=d.chunk_tokens, help="tokens per streamed chunk")
    a("--startup-delay-secs", type=float, default=d.startup_delay_secs)
    a("--disaggregation-mode", choices=DISAGG_MODES, default=d.disaggregation_mode)
    a("--disaggregation-bootstrap-port", "--bootstrap-port", dest="bootstrap_port", type=int,
      default=d.bootstrap_port)  # fmt: skip
    a("--disconnect-abort-delay-secs", type=float, default=d.disconnect_abort_delay_secs)
    a("--tokenizer-workers", type=int, default=d.tokenizer_workers)
    a("--fault", type=fault_arg, action="append", default=[], metavar="MATCH=KIND[:ARG]...",
      help="install a fault plan for request ids containing MATCH (repeatable)")  # fmt: skip


def config_from_args(args: argparse.Namespace) -> SglangEngineConfig:
    grpc_l: tuple[str, int] | None = args.grpc_listen
    http_l: tuple[str, int] | None = args.http_listen
    d = SglangEngineConfig()
    return SglangEngineConfig(
        grpc_host=grpc_l[0] if grpc_l else d.grpc_host,
        grpc_port=grpc_l[1] if grpc_l else None,
        http_host=http_l[0] if http_l else d.http_host,
        http_port=http_l[1] if http_l else None,
        incremental=args.incremental,
        model_path=args.model_path,
        served_model_name=args.served_model_name,
        eos_token_id=args.eos_token_id,
        vocab_size=args.vocab_size,
        context_length=args.context_length or d.context_length,
        context_length_flag=args.context_length,
        kv_capacity_tokens=args.kv_capacity_tokens,
        page_size=args.page_size,
        max_running_requests=args.max_running_requests,
        max_queued_requests=args.max_queued_requests,
        dp_size=args.dp_size,
        token_latency_ms=args.token_latency_ms,
        chunk_tokens=args.chunk_tokens,
        startup_delay_secs=args.startup_delay_secs,
        disaggregation_mode=args.disaggregation_mode,
        bootstrap_port=args.bootstrap_port,
        disconnect_abort_delay_secs=args.disconnect_abort_delay_secs,
        tokenizer_workers=args.tokenizer_workers,
    )


async def _serve(config: SglangEngineConfig, faults: list[tuple[str, FaultPlan]]) -> int:
    log = logging.getLogger("testkit.sglang")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    engine = SglangTestEngine(config)
    for match, plan in faults:
        engine.faults.add(match, plan)
    try:
        await engine.start()
        where = f"grpc={config.grpc_host}:{engine.grpc_port} http={config.http_host}:{engine.http_port}"
        log.info("testkit-engine sglang listening %s", where)
        ready = asyncio.ensure_future(engine.wait_ready(None))
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({ready, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if ready.done() and not ready.cancelled() and ready.exception() is None:
                log.info("testkit-engine sglang ready %s", where)
            await stopping
        finally:
            for fut in (ready, stopping):
                fut.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await fut
    finally:
        await engine.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    log.info("testkit-engine sglang stopped")
    return 0


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; exit 0."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"testkit-engine sglang: {e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_serve(config, list(args.fault)))
    except OSError as e:
        logging.getLogger("testkit.sglang").error("testkit-engine sglang: %s", e)
        return 1
