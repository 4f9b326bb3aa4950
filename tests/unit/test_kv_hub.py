"""The sidecar's WatchKvCache snapshots (sidecar_server.kv_hub): every chunk names the layout of
its keys, so a frontend that computes keys another way can tell before indexing any."""

from __future__ import annotations

import anyio

from sidecar_common.api import sidecar_pb2
from sidecar_common.kv_keys import KEY_SCHEME
from sidecar_server.kv_hub import KvCacheHub
from sidecar_server.kv_state import KvDelta

WAIT = 30.0


async def _first_snapshot(hub: KvCacheHub) -> list[sidecar_pb2.KvCacheSnapshot]:
    """The chunks of the snapshot a new watcher gets first."""
    chunks: list[sidecar_pb2.KvCacheSnapshot] = []
    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as tg:

            async def write(update: sidecar_pb2.KvCacheUpdate) -> None:
                assert update.HasField("snapshot")
                chunks.append(update.snapshot)
                if update.snapshot.last_chunk:
                    tg.cancel_scope.cancel()

            tg.start_soon(hub.watch, sidecar_pb2.WatchKvCacheRequest(), write)
    return chunks


async def test_every_snapshot_chunk_names_the_key_layout() -> None:
    hub = KvCacheHub(subscribed=True, epoch=7, chunk_blocks=2)
    hub.apply(0, KvDelta(added=((11, 1), (12, 11), (13, 12))), block_size=16)
    chunks = await _first_snapshot(hub)
    assert [list(c.keys) for c in chunks] == [[11, 12], [13]]
    assert [c.key_scheme for c in chunks] == [KEY_SCHEME, KEY_SCHEME]


async def test_the_empty_snapshot_of_a_sidecar_without_kv_events_names_it_too() -> None:
    (chunk,) = await _first_snapshot(KvCacheHub(subscribed=False))
    assert (chunk.last_chunk, chunk.key_scheme) == (True, KEY_SCHEME)
