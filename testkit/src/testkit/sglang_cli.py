"""``testkit-engine sglang ...``: the flags, and serving one engine until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys

from sidecar_common.endpoint import format_host_port
from sidecar_common.ports import bind_problem
from testkit.cli_args import fault_arg, kv_events_arg, optional_listen_arg
from testkit.faults import FaultPlan
from testkit.heap import freeze_startup_heap
from testkit.sglang_info import DISAGG_MODES, SglangEngineConfig

__all__ = ["add_arguments", "config_from_args", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``testkit-engine sglang``."""
    d = SglangEngineConfig()
    a = parser.add_argument
    a(
        "--grpc-listen",
        type=optional_listen_arg,
        default=f"{d.grpc_host}:30001",
        metavar="HOST:PORT",
        help="SglangService (gRPC) listen address, or 'off'",
    )
    a(
        "--http-listen",
        type=optional_listen_arg,
        default=f"{d.http_host}:30000",
        metavar="HOST:PORT",
        help="HTTP server listen address, or 'off'",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--incremental",
        dest="incremental",
        action="store_true",
        default=False,
        help="stream deltas (SGLang's --incremental-streaming-output)",
    )
    mode.add_argument(
        "--cumulative",
        dest="incremental",
        action="store_false",
        help="stream cumulative output_ids and text (default: on: SGLang's default)",
    )
    a("--model-path", default=d.model_path, help="the model path server info reports")
    a("--served-model-name", default=None, help="the model name reported (default: the model path)")
    a("--eos-token-id", type=int, default=d.eos_token_id, metavar="ID", help="end-of-sequence token")
    a("--vocab-size", type=int, default=d.vocab_size, metavar="N", help="token ids are below this")
    a(
        "--context-length",
        type=int,
        default=None,
        metavar="TOKENS",
        help="longest prompt plus output; server info reports it only when given "
        f"(default: {d.context_length})",
    )
    a(
        "--kv-capacity-tokens",
        "--max-total-tokens",
        dest="kv_capacity_tokens",
        type=int,
        default=d.kv_capacity_tokens,
        metavar="TOKENS",
        help="the KV token pool (SGLang's --max-total-tokens): max_total_num_tokens reported, and "
        "the prefix cache's capacity (TOKENS / --page-size pages)",
    )
    a(
        "--page-size",
        type=int,
        default=d.page_size,
        metavar="TOKENS",
        help="tokens per KV cache page (prefix caching, KV events, server info)",
    )
    a(
        "--kv-events-config",
        type=kv_events_arg("sglang"),
        default=None,
        metavar="JSON",
        help='SGLang\'s KV events: {"publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": ..., "topic": ..., "buffer_steps": ..., "bind": ...} (default: none published)',
    )
    a(
        "--prefill-us-per-token",
        type=float,
        default=d.prefill_us_per_token,
        metavar="US",
        help="testkit: the first token waits this long per prompt token not cached (default: 0)",
    )
    a(
        "--max-running-requests",
        type=int,
        default=d.max_running_requests,
        metavar="N",
        help="requests generated at once; more wait in a queue",
    )
    a("--dp-size", type=int, default=d.dp_size, metavar="N", help="data-parallel ranks reported")
    a(
        "--token-latency-ms",
        type=float,
        default=d.token_latency_ms,
        metavar="MS",
        help="time per generated token",
    )
    a(
        "--token-latency-slope-ms",
        type=float,
        default=d.token_latency_slope_ms,
        metavar="MS",
        help="testkit: each running request beyond the first adds this to every decode step",
    )
    a(
        "--chunk-tokens",
        type=int,
        default=d.chunk_tokens,
        metavar="N",
        help="tokens per streamed chunk (SGLang's --stream-interval)",
    )
    a(
        "--startup-delay-secs",
        type=float,
        default=d.startup_delay_secs,
        metavar="SECS",
        help="health answers not serving until then",
    )
    a(
        "--disaggregation-mode",
        choices=DISAGG_MODES,
        default=d.disaggregation_mode,
        help="disaggregation role reported",
    )
    a(
        "--disaggregation-bootstrap-port",
        "--bootstrap-port",
        dest="bootstrap_port",
        type=int,
        default=d.bootstrap_port,
        metavar="PORT",
        help="bootstrap port reported for prefill/decode handoffs",
    )
    a(
        "--disconnect-abort-delay-secs",
        type=float,
        default=d.disconnect_abort_delay_secs,
        metavar="SECS",
        help="how long after an HTTP client left its request is aborted, as SGLang does",
    )
    a(
        "--tokenizer-workers",
        type=int,
        default=d.tokenizer_workers,
        metavar="N",
        help="SGLang's tokenizer workers (with more than one, an abort by rid prefix matches)",
    )
    a(
        "--enable-lora",
        action="store_true",
        default=None,
        help="serve LoRA adapters (those of --lora-paths; any other is refused, as SGLang does)",
    )
    a(
        "--lora-paths",
        nargs="+",
        default=[],
        metavar="NAME[=PATH]",
        help="the LoRA adapters loaded at start, by name (given alone, they turn LoRA on)",
    )
    a(
        "--max-queued-requests",
        type=int,
        default=d.max_queued_requests,
        metavar="N",
        help="requests that may wait beyond the running ones; one more is refused with 503, "
        "as SGLang does (default: unset: no bound)",
    )
    a(
        "--weight-version",
        default=d.weight_version,
        metavar="VERSION",
        help="the weight version the engine starts with (updates change it)",
    )
    a(
        "--enable-return-routed-experts",
        action="store_true",
        help="answer return_routed_experts with the testkit's fake MoE routing (HTTP /generate)",
    )
    a(
        "--num-hidden-layers",
        type=int,
        default=d.num_hidden_layers,
        metavar="N",
        help="testkit: MoE layers in each routed-experts row",
    )
    a(
        "--num-experts-per-tok",
        type=int,
        default=d.num_experts_per_tok,
        metavar="K",
        help="testkit: experts each layer routes a token to",
    )
    a(
        "--num-experts",
        type=int,
        default=d.num_experts,
        metavar="E",
        help="testkit: expert ids are below this",
    )
    a(
        "--health-check-timeout-secs",
        type=float,
        default=d.health_check_timeout_secs,
        metavar="SECS",
        help="SGLang's SGLANG_HEALTH_CHECK_TIMEOUT: /health answers 503 after this while paused",
    )
    a(
        "--fault",
        type=fault_arg,
        action="append",
        default=[],
        metavar="MATCH=KIND[:ARG]...",
        help="install a fault plan for request ids containing MATCH (repeatable)",
    )


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
        enable_lora=args.enable_lora,
        lora_paths=tuple(path.split("=", 1)[0] for path in args.lora_paths),
        dp_size=args.dp_size,
        token_latency_ms=args.token_latency_ms,
        token_latency_slope_ms=args.token_latency_slope_ms,
        chunk_tokens=args.chunk_tokens,
        startup_delay_secs=args.startup_delay_secs,
        disaggregation_mode=args.disaggregation_mode,
        bootstrap_port=args.bootstrap_port,
        disconnect_abort_delay_secs=args.disconnect_abort_delay_secs,
        tokenizer_workers=args.tokenizer_workers,
        kv_events=args.kv_events_config,
        prefill_us_per_token=args.prefill_us_per_token,
        weight_version=args.weight_version,
        enable_return_routed_experts=args.enable_return_routed_experts,
        num_hidden_layers=args.num_hidden_layers,
        num_experts_per_tok=args.num_experts_per_tok,
        num_experts=args.num_experts,
        health_check_timeout_secs=args.health_check_timeout_secs,
    )


async def _serve(config: SglangEngineConfig, faults: list[tuple[str, FaultPlan]]) -> int:
    log = logging.getLogger("testkit.sglang")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # Imported once the flags are valid: --help and usage errors need neither grpc nor aiohttp.
    from testkit.sglang_engine import SglangTestEngine

    engine = SglangTestEngine(config)
    for match, plan in faults:
        engine.faults.add(match, plan)
    try:
        await engine.start()
        freeze_startup_heap()
        grpc_at = format_host_port(config.grpc_host, engine.grpc_port)
        where = f"grpc={grpc_at} http={format_host_port(config.http_host, engine.http_port)}"
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
        print(f"testkit-engine sglang: error: {e}", file=sys.stderr)
        return 2
    listeners = (args.grpc_listen, args.http_listen)
    for address in listeners:
        problem = bind_problem(*address) if address is not None else None
        if problem is not None:
            print(f"testkit-engine sglang: {problem}", file=sys.stderr)
            return 1
    try:
        return asyncio.run(_serve(config, list(args.fault)))
    except (OSError, RuntimeError) as e:
        # grpc reports a failed bind as a RuntimeError; another process may take the port
        # between the check above and the bind.
        print(f"testkit-engine sglang: cannot start: {e}", file=sys.stderr)
        return 1
