"""Cost of computing routing keys (sidecar_common.kv_keys) against prompt length and block size.

Run: ``.venv/bin/python -m bench.kv_keys``. Prints the best of several runs per case, in µs,
and the cost per block, for the token ids in the two forms the product holds them:

* ``message``: a ``sidecar.v1`` request's repeated field, as the frontend routes it
  (``block_key_chain``, the keys kept in an array);
* ``list``: a Python list, as the sidecar gets a KV event's tokens from msgpack
  (``block_keys``).

Issue 20 budgets a whole routing decision for an 8k-token prompt over 16 workers at 100 µs
(``python -m bench.kv_routing`` measures the decision).
"""

from __future__ import annotations

import functools
import random
import timeit
from collections.abc import Callable

from sidecar_common.api import sidecar_pb2
from sidecar_common.kv_keys import block_key_chain, block_keys

_CASES = ((1024, 16), (8192, 16), (32768, 16), (8192, 1), (2048, 64), (128, 16), (32, 16), (16, 1))


def _best_us(call: Callable[[], object], number: int) -> float:
    return min(timeit.repeat(call, number=number, repeat=9)) / number * 1e6


def main() -> None:
    rng = random.Random(20)
    for tokens, block_size in _CASES:
        token_ids = [rng.randrange(200_000) for _ in range(tokens)]
        message = sidecar_pb2.PreprocessedRequest(token_ids=token_ids)
        number = max(10, 20_000 // tokens)
        from_message = _best_us(functools.partial(block_key_chain, message.token_ids, block_size), number)
        from_list = _best_us(functools.partial(block_keys, token_ids, block_size), number)
        blocks = tokens // block_size
        print(
            f"{tokens:>6} tokens, block {block_size:>3}: {blocks:>6} keys; "
            f"message {from_message:>8.1f} us, list {from_list:>8.1f} us "
            f"({from_list * 1e3 / blocks:.0f} ns/key)"
        )


if __name__ == "__main__":
    main()
