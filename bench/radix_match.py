"""`python -m bench.radix_match` (also run by `python -m bench quick`): in-process prefix lookup for a 4,096-token
prompt (256 pages of 16) against a radix index holding 100,000 blocks; hashing is timed separately. Two layouts:

- shared: 8 system prompts of 64 pages, each followed by a unique 192-page conversation (few, long edges).
- branchy: the query path branches at every one of its 256 pages (256 nodes to walk: the worst case for match).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

from bench import Row
from radixserve.blocks.keys import block_hashes, namespace_key
from radixserve.blocks.radix import RadixIndex

PAGE, PROMPT_TOKENS, INDEX_BLOCKS = 16, 4096, 100_000
NS = namespace_key("bench-model", "")
MATCH_GOAL_US = 100


def timed_us(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """(median, p99) wall time of `fn` in microseconds over `reps` calls, after a warm-up."""
    for _ in range(min(reps, 50)):
        fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1e3)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99)]


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(49_152) for _ in range(n)]


def shared_layout(rng: random.Random) -> tuple[RadixIndex, list]:
    systems = [tokens(rng, 64 * PAGE) for _ in range(8)]
    index, slots, prompts = RadixIndex(), iter(range(10**9)), []
    while index.total_pages < INDEX_BLOCKS:
        prompts.append(block_hashes(NS, rng.choice(systems) + tokens(rng, 192 * PAGE), PAGE))
        index.insert(prompts[-1], [next(slots) for _ in prompts[-1]])
    return index, rng.choice(prompts)


def branchy_layout(rng: random.Random) -> tuple[RadixIndex, list]:
    query = tokens(rng, PROMPT_TOKENS)
    index, slots = RadixIndex(), iter(range(10**9))
    branch_pages = INDEX_BLOCKS // (PROMPT_TOKENS // PAGE)
    for page in range(PROMPT_TOKENS // PAGE):
        branch = block_hashes(NS, query[:page * PAGE] + tokens(rng, branch_pages * PAGE), PAGE)
        index.insert(branch, [next(slots) for _ in branch])
    hashes = block_hashes(NS, query, PAGE)
    index.insert(hashes, [next(slots) for _ in hashes])
    return index, hashes


def lock_and_unlock(index: RadixIndex, hashes: list) -> None:
    index.unlock(index.match(hashes, lock=True).lease)


def measure(name: str, index: RadixIndex, hashes: list, miss: list) -> list[Row]:
    """Rows for a full hit, a miss and a lock + unlock of `hashes` against `index`."""
    hit = index.match(hashes).pages
    if hit != len(hashes):
        raise AssertionError(f"{name}: the query hits {hit} of its {len(hashes)} pages")
    rows = []
    for what, fn, goal in (
            ("match, full hit", lambda: index.match(hashes), f"<= {MATCH_GOAL_US} us"),
            ("match, miss", lambda: index.match(miss), ""),
            ("match(lock=True) + unlock", lambda: lock_and_unlock(index, hashes), "")):
        med, p99 = timed_us(fn, 2000)
        label = f"{name} ({index.total_pages} blocks): {what}, {len(hashes)} pages"
        rows += [Row(f"{label}, median", med, None, "us", goal), Row(f"{label}, p99", p99, None, "us", "")]
    index.check_integrity()
    return rows


def run() -> list[Row]:
    rng = random.Random(0)
    prompt = tokens(rng, PROMPT_TOKENS)
    med, p99 = timed_us(lambda: block_hashes(NS, prompt, PAGE), 500)
    rows = [Row(f"block_hashes, {PROMPT_TOKENS} tokens / {PROMPT_TOKENS // PAGE} pages, median", med, None, "us", ""),
            Row(f"block_hashes, {PROMPT_TOKENS} tokens / {PROMPT_TOKENS // PAGE} pages, p99", p99, None, "us", "")]
    for name, layout in (("shared", shared_layout), ("branchy", branchy_layout)):
        index, hashes = layout(rng)
        rows += measure(name, index, hashes, block_hashes(NS, tokens(rng, PROMPT_TOKENS), PAGE))
    return rows


def main() -> None:
    for row in run():
        print(f"{row.name}: {row.ours:.1f} {row.unit}")


if __name__ == "__main__":
    main()
