"""``testkit-engine vllm|sglang ...``: run a testkit engine until SIGTERM/SIGINT (exit 0)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from typing import TYPE_CHECKING

from sidecar_common.flags import FlagParser
from sidecar_common.ports import bind_problem
from testkit.book import Book
from testkit.cli_args import fault_arg, kv_events_arg, listen_arg
from testkit.faults import FaultBook, FaultPlan, parse_directive
from testkit.heap import freeze_startup_heap
from testkit.sglang_cli import add_arguments as add_sglang_arguments
from testkit.sglang_cli import run as run_sglang
from testkit.vllm_config import VllmEngineConfig

if TYPE_CHECKING:
    from aiohttp import web

__all__ = ["add_vllm_arguments", "control_app", "listen_problem", "main", "run_vllm", "vllm_config_from_args"]

_log = logging.getLogger("testkit.vllm")


def control_app(book: Book, faults: FaultBook) -> web.Application:
    """The out-of-process control endpoint: read the book, install and clear fault plans.

    ``GET /book``; ``POST /faults`` with ``{"match": ..., "fault": "close_after:3", "times": 1}``;
    ``DELETE /faults``.
    """
    # aiohttp's server and the engine are imported when serving: --help and usage errors
    # import neither.
    from aiohttp import web

    async def get_book(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "running": book.running_ids(),
                "waiting": book.waiting_ids(),
                "aborts": book.aborts,
                "received": [rid for rid, _ in book.received],
                "finished": [
                    {"request_id": r.request_id, "outcome": r.outcome.value, "detail": r.detail}
                    for r in book.finished
                ],
            }
        )

    async def add_fault(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            times = body.get("times")
            faults.add(str(body["match"]), parse_directive(str(body["fault"])), times)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return web.json_response({"error": f"bad fault: {e}"}, status=400)
        return web.json_response({"ok": True})

    async def clear_faults(_: web.Request) -> web.Response:
        faults.clear()
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/book", get_book)
    app.router.add_post("/faults", add_fault)
    app.router.add_delete("/faults", clear_faults)
    return app


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    d = VllmEngineConfig()
    a = parser.add_argument
    a(
        "--listen",
        type=listen_arg,
        default=f"{d.host}:50051",
        metavar="HOST:PORT",
        help="gRPC listen address (VllmEngine and gRPC health); port 0 picks a free one",
    )
    a("--served-model-name", default=d.served_model_name, help="the model name GetModelInfo reports")
    a("--model-path", default=d.model_path, help="the model path GetModelInfo reports")
    a(
        "--context-length",
        type=int,
        default=d.context_length,
        metavar="TOKENS",
        help="longest prompt plus output accepted",
    )
    a("--vocab-size", type=int, default=d.vocab_size, metavar="N", help="token ids are below this")
    a(
        "--eos-token-id",
        type=int,
        action="append",
        default=None,
        metavar="ID",
        help=f"end-of-sequence token; repeatable, the first is the primary (default: {d.eos_token_ids[0]})",
    )
    a(
        "--kv-role",
        choices=["", "kv_producer", "kv_consumer", "kv_both"],
        default=d.kv_role,
        help="KV transfer role reported for disaggregation (default: none)",
    )
    a("--kv-engine-id", default=d.kv_engine_id, help="engine id announced in a prefill's handoff")
    a("--kv-host", default=d.kv_host, help="host announced in a prefill's handoff")
    a("--kv-port", type=int, default=d.kv_port, help="port announced in a prefill's handoff")
    a(
        "--data-parallel-size",
        type=int,
        default=d.data_parallel_size,
        metavar="N",
        help="data-parallel ranks reported",
    )
    a(
        "--block-size",
        type=int,
        default=d.block_size,
        metavar="TOKENS",
        help="tokens per KV cache block (prefix caching, KV events, GetServerInfo)",
    )
    a(
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        metavar="BLOCKS",
        help="prefix cache capacity in blocks (default: --total-kv-tokens / --block-size)",
    )
    a(
        "--kv-events-config",
        type=kv_events_arg("vllm"),
        default=None,
        metavar="JSON",
        help='vLLM\'s KV events: {"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
        '"replay_endpoint": ..., "topic": ..., "buffer_steps": ...} (default: none published)',
    )
    a(
        "--prefill-us-per-token",
        type=float,
        default=d.prefill_us_per_token,
        metavar="US",
        help="testkit: the first token waits this long per prompt token not cached (default: 0)",
    )
    a(
        "--max-running",
        "--max-num-seqs",
        dest="max_num_seqs",
        type=int,
        default=d.max_num_seqs,
        metavar="N",
        help="requests generated at once; more wait in a queue",
    )
    a(
        "--max-num-queued-reqs",
        type=int,
        default=None,
        metavar="N",
        help="vLLM's admission limit: a request past N unfinished ones is refused busy (503)",
    )
    a(
        "--max-num-queued-tokens",
        type=int,
        default=None,
        metavar="TOKENS",
        help="vLLM's admission limit: refused busy while this many prompt tokens are in prefill",
    )
    a(
        "--total-kv-tokens",
        type=int,
        default=d.total_kv_tokens,
        metavar="TOKENS",
        help="KV cache capacity reported in the load",
    )
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
    a("--chunk-tokens", type=int, default=d.chunk_tokens, metavar="N", help="tokens per streamed chunk")
    a(
        "--startup-delay-secs",
        type=float,
        default=d.startup_delay_secs,
        metavar="SECS",
        help="refuse connections until then",
    )
    a("--supports-vision", action="store_true", help="report a model that accepts images")
    a("--max-logprobs", type=int, default=d.max_logprobs, metavar="N", help="vLLM's --max-logprobs")
    a(
        "--fault",
        type=fault_arg,
        action="append",
        default=[],
        metavar="MATCH=KIND[:ARG]...",
        help="install a fault plan for request ids containing MATCH (repeatable)",
    )
    a(
        "--control-listen",
        type=listen_arg,
        default=None,
        metavar="HOST:PORT",
        help="HTTP control endpoint: GET /book, POST and DELETE /faults (default: unset: off)",
    )
    a(
        "--admin-listen",
        type=listen_arg,
        default=None,
        metavar="HOST:PORT",
        help="HTTP admin port with vLLM's RL routes: /pause, /resume, /is_paused, "
        "/update_weight_version, /weight_info... (vLLM serves them only over HTTP; default: off)",
    )


def vllm_config_from_args(args: argparse.Namespace) -> VllmEngineConfig:
    host, port = args.listen
    return VllmEngineConfig(
        host=host,
        port=port,
        served_model_name=args.served_model_name,
        model_path=args.model_path,
        context_length=args.context_length,
        vocab_size=args.vocab_size,
        eos_token_ids=tuple(args.eos_token_id) if args.eos_token_id else VllmEngineConfig().eos_token_ids,
        kv_role=args.kv_role,
        kv_engine_id=args.kv_engine_id,
        kv_host=args.kv_host,
        kv_port=args.kv_port,
        data_parallel_size=args.data_parallel_size,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        total_kv_tokens=args.total_kv_tokens,
        token_latency_ms=args.token_latency_ms,
        token_latency_slope_ms=args.token_latency_slope_ms,
        chunk_tokens=args.chunk_tokens,
        startup_delay_secs=args.startup_delay_secs,
        supports_vision=args.supports_vision,
        max_logprobs=args.max_logprobs,
        max_num_queued_reqs=args.max_num_queued_reqs,
        max_num_queued_tokens=args.max_num_queued_tokens,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        kv_events=args.kv_events_config,
        prefill_us_per_token=args.prefill_us_per_token,
        admin_host=args.admin_listen[0] if args.admin_listen else VllmEngineConfig().admin_host,
        admin_port=args.admin_listen[1] if args.admin_listen else None,
    )


async def _serve_vllm(
    config: VllmEngineConfig, faults: list[tuple[str, FaultPlan]], control: tuple[str, int] | None
) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    from aiohttp import web

    from testkit.vllm_engine import VllmTestEngine

    engine = VllmTestEngine(config)
    for match, plan in faults:
        engine.faults.add(match, plan)
    runner: web.AppRunner | None = None
    try:
        if control is not None:
            runner = web.AppRunner(control_app(engine.book, engine.faults), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, control[0], control[1])
            await site.start()
            _log.info("control on %s:%d", control[0], runner.addresses[0][1])
        port = await engine.start()
        freeze_startup_heap()
        if engine.admin_port is not None:
            _log.info("admin on %s:%d", config.admin_host, engine.admin_port)
        ready = asyncio.ensure_future(engine.wait_ready(config.startup_delay_secs + 3600))
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({ready, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if ready.done() and not ready.cancelled() and ready.exception() is None:
                _log.info("ready on %s:%d", config.host, port)
            await stopping
        finally:
            for fut in (ready, stopping):
                fut.cancel()
                with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                    await fut
    finally:
        await engine.stop(1.0)
        if runner is not None:
            await runner.cleanup()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    _log.info("stopped")
    return 0


def listen_problem(*addresses: tuple[str, int] | None) -> str | None:
    """Why one of the listen addresses cannot be bound (a taken port...), or None."""
    for address in addresses:
        if address is not None:
            problem = bind_problem(*address)
            if problem is not None:
                return problem
    return None


def run_vllm(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT (exit 0); a bad value exits 2, a failed start-up (a taken
    port) 1, each with one line, as the sidecars do."""
    try:
        config = vllm_config_from_args(args)
    except ValueError as e:
        print(f"testkit-engine vllm: error: {e}", file=sys.stderr)
        return 2
    problem = listen_problem((config.host, config.port), args.control_listen, args.admin_listen)
    if problem is not None:
        print(f"testkit-engine vllm: {problem}", file=sys.stderr)
        return 1
    try:
        return asyncio.run(_serve_vllm(config, list(args.fault), args.control_listen))
    except (OSError, RuntimeError) as e:
        # grpc reports a failed bind as a RuntimeError; another process may take the port
        # between the check above and the bind.
        print(f"testkit-engine vllm: cannot start: {e}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    parser = FlagParser(prog="testkit-engine", description="CPU engines on the real native wires")
    sub = parser.add_subparsers(dest="engine", metavar="{vllm,sglang}")
    add_vllm_arguments(sub.add_parser("vllm", help="vllm.grpc.engine.VllmEngine + gRPC health"))
    add_sglang_arguments(sub.add_parser("sglang", help="SGLang native gRPC and HTTP"))
    args = parser.parse_args(argv)
    if args.engine == "vllm":
        return run_vllm(args)
    if args.engine == "sglang":
        return run_sglang(args)
    parser.error("an engine is required (choose from vllm, sglang)")


if __name__ == "__main__":
    sys.exit(main())
