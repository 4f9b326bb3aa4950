"""The sidecar's WatchKvCache snapshots (sidecar_server.kv_hub): every chunk names the layout of
its keys, so a frontend that computes keys another way can tell before indexing any."""

from __future__ import annotations

import anyio

from sidecar_common.api import sidecar_pb2
from sidecar_common.kv_keys import KEY_SCHEME, block_keys, root_key
from sidecar_server.kv_config import KvEventsConfig
from sidecar_server.kv_hub import KvCacheHub, Subscription
from sidecar_server.kv_state import KvDelta
from sidecar_server.kv_subscriber import KvSubscriber

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


def _request(tokens: list[int], cache_namespace: str | None = None) -> sidecar_pb2.PreprocessedRequest:
    request = sidecar_pb2.PreprocessedRequest(token_ids=tokens)
    if cache_namespace is not None:
        request.routing.cache_namespace = cache_namespace
    return request


async def _next_delta(hub: KvCacheHub, after: int) -> sidecar_pb2.KvCacheDelta:
    got: list[sidecar_pb2.KvCacheDelta] = []
    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as tg:

            async def write(update: sidecar_pb2.KvCacheUpdate) -> None:
                if update.HasField("delta"):
                    got.append(update.delta)
                    tg.cancel_scope.cancel()

            request = sidecar_pb2.WatchKvCacheRequest(epoch=hub.view.epoch, sequence=after)
            tg.start_soon(hub.watch, request, write)
    return got[0]


async def test_an_accepted_request_announces_its_uncached_blocks_to_the_watchers() -> None:
    hub = KvCacheHub(subscribed=True, epoch=7)
    tokens = list(range(1_000, 1_050))  # 3 full blocks of 16, and 2 tokens more
    keys = block_keys(tokens, 16, cache_salt="s")
    hub.apply(0, KvDelta(added=((keys[0], root_key(cache_salt="s")),)), block_size=16)
    hub.batches_received = 1
    hub.announce(_request(tokens, cache_namespace="s"))
    delta = await _next_delta(hub, after=1)
    assert list(delta.announced_keys) == keys[1:]  # the first block is cached already
    assert (list(delta.added_keys), list(delta.removed)) == ([], [])


async def test_nothing_is_announced_without_events_a_block_size_or_tokens_alone() -> None:
    tokens = list(range(64))
    unsubscribed = KvCacheHub(subscribed=False)
    unsubscribed.set_model("m", 16)
    unsubscribed.announce(_request(tokens))
    # Subscribed, but the engine has published nothing: frontends route it on their own.
    silent = KvCacheHub(subscribed=True)
    silent.set_model("m", 16)
    silent.announce(_request(tokens))
    no_block_size = KvCacheHub(subscribed=True)
    no_block_size.batches_received = 1
    no_block_size.announce(_request(tokens))
    with_images = KvCacheHub(subscribed=True)
    with_images.batches_received = 1
    with_images.set_model("m", 16)
    with_images.announce(
        sidecar_pb2.PreprocessedRequest(
            token_ids=tokens,
            multi_modal_data=[sidecar_pb2.MultimodalItem(kind=sidecar_pb2.MultimodalItem.IMAGE)],
        )
    )
    assert [hub.view.sequence for hub in (unsubscribed, silent, no_block_size, with_images)] == [0, 0, 0, 0]


def test_subscribers_hear_until_they_close_their_subscription() -> None:
    hub = KvCacheHub(subscribed=True)
    heard: list[tuple[str, object]] = []
    first = hub.subscribe_engine_health(lambda ok: heard.append(("first", ok)))
    second = hub.subscribe_engine_health(lambda ok: heard.append(("second", ok)))
    lag = hub.subscribe_lag(lambda secs: heard.append(("lag", secs)))
    hub.engine_health(False)
    hub.batch_lag(0.25)
    assert heard == [("first", False), ("second", False), ("lag", 0.25)]
    first.close()
    first.close()  # closing again does nothing (and removes nobody else)
    with lag:
        pass
    hub.engine_health(True)
    hub.batch_lag(0.5)
    assert heard[3:] == [("second", True)]
    assert hub.subscribers == (1, 0)
    second.close()
    assert hub.subscribers == (0, 0)


def test_a_subscriber_that_leaves_while_told_misses_no_other() -> None:
    hub = KvCacheHub(subscribed=True)
    heard: list[str] = []
    subscriptions: list[Subscription] = []

    def leaves(ok: bool) -> None:
        heard.append("leaves")
        subscriptions[0].close()

    subscriptions.append(hub.subscribe_engine_health(leaves))
    subscriptions.append(hub.subscribe_engine_health(lambda ok: heard.append("stays")))
    hub.engine_health(False)
    hub.engine_health(False)
    assert heard == ["leaves", "stays", "stays"]


async def test_the_kv_subscriber_listens_to_the_engines_health_only_while_it_runs() -> None:
    hub = KvCacheHub(subscribed=True)
    # Nothing listens on these ports: ZeroMQ connects lazily, so the feeds just wait.
    config = KvEventsConfig(endpoint="tcp://127.0.0.1:9", replay_endpoint="tcp://127.0.0.1:9")
    subscriber = KvSubscriber(config, hub, ranks=2)
    assert hub.subscribers == (0, 0)
    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(subscriber.run)
            while hub.subscribers == (0, 0):  # noqa: ASYNC110 - the subscription has no event
                await anyio.sleep(0.01)
            hub.engine_health(False)  # the feeds resync (and ask for replays)
            tg.cancel_scope.cancel()
    # Stopped, its feeds are no longer told (nothing would read their replay requests).
    assert hub.subscribers == (0, 0)
