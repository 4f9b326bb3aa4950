"""Cost of computing routing keys (sidecar_common.kv_keys) against prompt length and block size.

Run: ``.venv/bin/python -m bench.kv_keys``. Prints the best of several runs per case, in µs,
and the cost per block. The frontend computes these keys once per request before it walks its
index (issue 20 budgets a whole routing decision for an 8k-token prompt at 100 µs).
"""

from __future__ import annotations

import functools
import random
import timeit

from sidecar_common.kv_keys import block_keys

_CASES = ((1024, 16), (8192, 16), (32768, 16), (8192, 1), (2048, 64))


def main() -> None:
    rng = random.Random(20)
    for tokens, block_size in _CASES:
        token_ids = [rng.randrange(200_000) for _ in range(tokens)]
        runs = timeit.repeat(functools.partial(block_keys, token_ids, block_size), number=10, repeat=9)
        best = min(runs) / 10
        blocks = tokens // block_size
        print(
            f"{tokens:>6} tokens, block {block_size:>3}: {blocks:>6} keys "
            f"{best * 1e6:>9.1f} us  ({best * 1e9 / blocks:.0f} ns/key)"
        )


if __name__ == "__main__":
    main()
