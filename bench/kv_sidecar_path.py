"""CPU a sidecar spends per KV-event block: decode, apply, relay (in process, no sockets).

Run: ``.venv/bin/python -m bench.kv_sidecar_path``. Feeds pre-encoded batches through the
sidecar's own code: :func:`sidecar_server.kv_events.decode_batch`, a
:class:`~sidecar_server.kv_state.RankFeed` and the :class:`~sidecar_server.kv_hub.KvCacheHub`
(its merged view), then builds the ``WatchKvCache`` update one watching frontend would get
(``relay``). Each batch stores one request's 80 new blocks of 16 tokens and removes the 80
blocks stored two batches before (a steady cache: as many blocks leave as arrive). Shapes:

- ``vllm``: ``BlockStored`` events of 8 blocks each, chained to the previous event's last
  block, with vLLM's per-block ``extra_keys`` (``None`` each) and ``group_idx``; one
  ``BlockRemoved`` event per removed block, as vLLM sends them.
- ``sglang``: the same stores without ``extra_keys``, signed hashes, and the removals merged
  into one ``BlockRemoved`` event, as SGLang sends them.

Prints, per block (stored or removed, 160 a batch), the CPU time (``time.process_time``) of
each stage, the minimum over rounds.

Figures (CPython 3.11, msgspec 0.23, protobuf 7.36 upb; this repository's 2-core machine,
shared, load average 0.6-0.7; two interleaved runs each, 03:16 UTC), µs per block,
decode / apply / relay / total:

- before (main at 054f1e0): vllm 0.65 / 2.74-2.78 / 0.17 / 3.57-3.61;
  sglang 0.39 / 2.42-2.47 / 0.17 / 2.98-3.03 (571-578 and 476-485 µs a batch).
- after: vllm 0.42-0.44 / 1.53-1.54 / 0.17 / 2.13-2.15;
  sglang 0.29-0.30 / 1.44-1.46 / 0.17 / 1.91-1.93 (341-343 and 305-308 µs a batch).

What changed: a batch of known events decodes in one msgspec call (vLLM's one event per
removed block had been one call each) into untracked (``gc=False``) structs; the map keeps a
key's parent in one dict (no object per block), runs a batch's consecutive removals in one
loop, and skips ``block_identity`` per block when no block after the first has extra keys;
the view's per-key loops are inlined; and ``kv_keys.extend_keys`` starts each block's BLAKE2b
from a copy of one configured state (the same keys, 0.94 -> 0.62 µs each). Of the 1.5 µs of
``apply`` left, about 0.42 µs is computing the 80 stored blocks' keys (10 extend_keys calls).
- key layout 2 (sidecar_common/kv_keys.py: values in numpy, for the routing decision's sake;
  05:40 UTC, quiet): vllm 0.44 / 1.94 / 0.18 / 2.57; sglang 0.31 / 1.86 / 0.18 / 2.35 (BLAKE2b
  keys in the same hour: 2.24 / 2.00). An event of 8 blocks of 16 is where numpy's fixed cost
  shows most; the hundreds of blocks of a chunked prefill's events cost less than before.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import msgspec
from testkit.kv_events import (
    SglangAllBlocksCleared,
    SglangBlockRemoved,
    SglangBlockStored,
    SglangKVEventBatch,
    VllmAllBlocksCleared,
    VllmBlockRemoved,
    VllmBlockStored,
    VllmKVEventBatch,
)

from sidecar_server.kv_events import DecodedBatch, decode_batch
from sidecar_server.kv_hub import KvCacheHub
from sidecar_server.kv_state import RankFeed
from sidecar_server.kv_view import NumberedDelta

BLOCK_SIZE = 16
BLOCKS_PER_BATCH = 80
BLOCKS_PER_EVENT = 8
BATCHES = 200
# Batches applied before the clock starts, so every timed batch removes blocks the map holds.
WARM = 2
ROUNDS = 15

_ENCODER = msgspec.msgpack.Encoder()


def _chains(rng: random.Random, signed: bool) -> list[tuple[list[int], list[int]]]:
    """Per batch: the stored chain's engine hashes and token ids (fresh tokens, no sharing)."""
    low, high = (-(1 << 63), (1 << 63) - 1) if signed else (0, (1 << 64) - 1)
    return [
        (
            [rng.randint(low, high) for _ in range(BLOCKS_PER_BATCH)],
            [rng.randrange(150_000) for _ in range(BLOCKS_PER_BATCH * BLOCK_SIZE)],
        )
        for _ in range(BATCHES)
    ]


def _payloads(flavor: str, rng: random.Random) -> list[bytes]:
    chains = _chains(rng, signed=flavor == "sglang")
    payloads: list[bytes] = []
    step = BLOCKS_PER_EVENT * BLOCK_SIZE
    for index, (hashes, tokens) in enumerate(chains):
        gone = chains[index - WARM][0] if index >= WARM else []
        ts = 1_700_000_000.0 + index
        if flavor == "vllm":
            vllm_events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared] = [
                VllmBlockStored(
                    block_hashes=hashes[start : start + BLOCKS_PER_EVENT],
                    parent_block_hash=hashes[start - 1] if start else None,
                    token_ids=tokens[start * BLOCK_SIZE : start * BLOCK_SIZE + step],
                    block_size=BLOCK_SIZE,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    extra_keys=[None] * BLOCKS_PER_EVENT,
                    group_idx=0,
                )
                for start in range(0, BLOCKS_PER_BATCH, BLOCKS_PER_EVENT)
            ]
            vllm_events += [VllmBlockRemoved(block_hashes=[h], medium="GPU", group_idx=0) for h in gone]
            payloads.append(
                _ENCODER.encode(VllmKVEventBatch(ts=ts, events=vllm_events, data_parallel_rank=0))
            )
        else:
            sglang_events: list[SglangBlockStored | SglangBlockRemoved | SglangAllBlocksCleared] = [
                SglangBlockStored(
                    block_hashes=hashes[start : start + BLOCKS_PER_EVENT],
                    parent_block_hash=hashes[start - 1] if start else None,
                    token_ids=tokens[start * BLOCK_SIZE : start * BLOCK_SIZE + step],
                    block_size=BLOCK_SIZE,
                    lora_id=None,
                    medium="GPU",
                )
                for start in range(0, BLOCKS_PER_BATCH, BLOCKS_PER_EVENT)
            ]
            if gone:
                sglang_events.append(SglangBlockRemoved(block_hashes=list(gone), medium="GPU"))
            payloads.append(_ENCODER.encode(SglangKVEventBatch(ts=ts, events=sglang_events, attn_dp_rank=0)))
    return payloads


def _cpu(work: Callable[[], object]) -> float:
    start = time.process_time()
    work()
    return time.process_time() - start


def _round(payloads: list[bytes]) -> tuple[float, float, float]:
    """One pass over every batch: the CPU seconds of decode, apply and relay."""
    hub = KvCacheHub(subscribed=True, epoch=1, kept_deltas=BATCHES + 1)
    feed = RankFeed(replay=False)
    warm, timed = payloads[:WARM], payloads[WARM:]
    for sequence, payload in enumerate(warm):
        for delta in feed.on_live(sequence, decode_batch(payload)).deltas:
            hub.apply(0, delta, feed.map.block_size)
    batches: list[DecodedBatch] = []
    numbered: list[NumberedDelta] = []

    def decode() -> None:
        batches.extend(decode_batch(payload) for payload in timed)

    def apply() -> None:
        for sequence, batch in enumerate(batches, start=WARM):
            for delta in feed.on_live(sequence, batch).deltas:
                merged = hub.apply(0, delta, feed.map.block_size)
                if merged is not None:
                    numbered.append(merged)

    def relay() -> None:
        for each in numbered:
            hub._delta_update(each).SerializeToString()

    return _cpu(decode), _cpu(apply), _cpu(relay)


def main() -> None:
    blocks = (BATCHES - WARM) * 2 * BLOCKS_PER_BATCH
    print(f"µs per block ({BLOCKS_PER_BATCH} stored + {BLOCKS_PER_BATCH} removed a batch), best of {ROUNDS}")
    for flavor in ("vllm", "sglang"):
        payloads = _payloads(flavor, random.Random(20))
        rounds = [_round(payloads) for _ in range(ROUNDS)]
        decode, apply, relay = (min(stage) * 1e6 / blocks for stage in zip(*rounds, strict=True))
        total = decode + apply + relay
        print(
            f"{flavor:>6}: decode {decode:5.2f}  apply {apply:5.2f}  relay {relay:5.2f}  "
            f"total {total:5.2f}  ({total * 2 * BLOCKS_PER_BATCH:.0f} µs a batch)"
        )


if __name__ == "__main__":
    main()
