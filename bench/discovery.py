"""``python -m bench.discovery [--rounds N]``: how fast a fleet change reaches a frontend's
worker set through etcd.

One etcd, one testkit vLLM engine, and in this process the frontend's worker set fed by etcd
discovery. Each round starts a ``sidecar-vllm`` that registers itself, then stops it with
SIGTERM. Measured per round, from events (an etcd watch of our own, the worker set's state):

* join: the worker's key appears in etcd -> the worker set has it SERVING (it takes traffic);
* leave: the key is deleted by the draining sidecar -> the worker set no longer picks it.

Needs ``etcd`` on PATH (``scripts/ensure_system_tools.sh``).
"""

from __future__ import annotations

import argparse
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio

from bench.procs import Proc, free_port, wait_http_ready
from sidecar_common.logs import configure_logging
from sidecar_common.registration_etcd import open_session
from sidecar_common.registration_record import DEFAULT_PREFIX
from sidecar_frontend.discovery import DiscoveryConfig, run_discovery
from sidecar_frontend.workers import WorkerSet

_WAIT = 30.0
BIN = Path(sys.executable).parent


def _etcd(data_dir: Path, client: int, peer: int) -> Proc:
    etcd = shutil.which("etcd")
    if etcd is None:
        raise SystemExit("etcd is not on PATH: run scripts/ensure_system_tools.sh")
    c, p = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    argv = [etcd, "--name=bench", f"--data-dir={data_dir}", f"--listen-client-urls={c}"]
    argv += [f"--advertise-client-urls={c}", f"--listen-peer-urls={p}", f"--initial-advertise-peer-urls={p}"]
    argv += [f"--initial-cluster=bench={p}", "--log-level=warn", "--logger=zap"]
    return Proc("etcd", argv, None)


async def _round(workers: WorkerSet, etcd: str, engine_port: int, index: int) -> tuple[float, float]:
    port = free_port()
    address = f"127.0.0.1:{port}"
    key = f"{DEFAULT_PREFIX}{address}".encode()
    argv = [str(BIN / "sidecar-vllm"), "--grpc-endpoint", f"127.0.0.1:{engine_port}", "--listen", address]
    argv += ["--grpc-connections", "1", "--etcd-endpoints", etcd, "--log-format", "json"]
    async with open_session(etcd, 5.0) as session:
        revision = (await session.get_prefix(key)).revision
        sidecar = Proc(f"sidecar-{index}", argv, None).start()
        try:
            with anyio.fail_after(_WAIT):
                async with session.watch_prefix(key, revision + 1) as events:
                    async for event in events:
                        if event.kind == "put":
                            break
                appeared = time.perf_counter()
                while address not in {w.address for w in workers.serving()}:
                    await workers.wait_serving(len(workers.serving()) + 1)
                join = time.perf_counter() - appeared
                revision = (await session.get_prefix(key)).revision
                assert sidecar.popen is not None
                sidecar.popen.send_signal(signal.SIGTERM)
                async with session.watch_prefix(key, revision + 1) as events:
                    async for event in events:
                        if event.kind == "delete":
                            break
                deleted = time.perf_counter()
                while address in {w.address for w in workers.serving()}:  # noqa: ASYNC110 - the set has no leave event
                    await anyio.sleep(0.0005)
                leave = time.perf_counter() - deleted
            sidecar.popen.wait(timeout=_WAIT)
        finally:
            sidecar.stop()
    return join, leave


async def _main(rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        client, peer, engine_port = free_port(), free_port(), free_port()
        etcd = _etcd(Path(tmp) / "etcd", client, peer).start()
        engine = Proc(
            "engine", [str(BIN / "testkit-engine"), "vllm", "--listen", f"127.0.0.1:{engine_port}"], None
        )
        engine.start()
        try:
            wait_http_ready(etcd, f"http://127.0.0.1:{client}/health", _WAIT)
            endpoint = f"127.0.0.1:{client}"
            config = DiscoveryConfig(mode="etcd", etcd_endpoints=(endpoint,))
            joins: list[float] = []
            leaves: list[float] = []
            async with WorkerSet() as workers, anyio.create_task_group() as tg:
                await tg.start(run_discovery, config, workers)
                for index in range(rounds):
                    join, leave = await _round(workers, endpoint, engine_port, index)
                    joins.append(join)
                    leaves.append(leave)
                tg.cancel_scope.cancel()
        finally:
            engine.stop()
            etcd.stop()
    for name, values in (
        ("join (key put -> SERVING in the set)", joins),
        ("leave (key deleted -> not picked)", leaves),
    ):
        ms = sorted(v * 1000 for v in values)
        print(f"{name}: median {statistics.median(ms):.1f} ms, max {ms[-1]:.1f} ms over {len(ms)} rounds")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    configure_logging("console", "warning")
    anyio.run(_main, args.rounds)


if __name__ == "__main__":
    main()
