"""`python -m bench.radix_match`: in-process prefix lookup for a 4,096-token prompt (256 pages of 16) against a
radix index holding 100,000 blocks; hashing is timed separately. Two layouts:

- shared: 8 system prompts of 64 pages, each followed by a unique 192-page conversation (few, long edges).
- branchy: the query path branches at every one of its 256 pages (256 nodes to walk: the worst case for match).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

from kvcached.keys import block_hashes, namespace_key
from kvcached.radix import RadixIndex

PAGE, PROMPT_TOKENS, INDEX_BLOCKS = 16, 4096, 100_000
NS = namespace_key("bench-model", "")


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


def report(name: str, index: RadixIndex, hashes: list, miss: list) -> None:
    print(f"{name}: {index.total_pages} blocks cached, hit of {index.match(hashes).pages} pages")
    for what, fn in (("match, full hit", lambda: index.match(hashes)),
                     ("match, miss", lambda: index.match(miss)),
                     ("match(lock=True) + unlock", lambda: lock_and_unlock(index, hashes))):
        med, p99 = timed_us(fn, 2000)
        print(f"  {what}: median {med:.1f} us, p99 {p99:.1f} us")
    index.check_integrity()


def main() -> None:
    rng = random.Random(0)
    prompt = tokens(rng, PROMPT_TOKENS)
    med, p99 = timed_us(lambda: block_hashes(NS, prompt, PAGE), 500)
    print(f"block_hashes, {PROMPT_TOKENS} tokens / {len(prompt) // PAGE} pages: median {med:.0f} us, p99 {p99:.0f} us")
    for name, layout in (("shared", shared_layout), ("branchy", branchy_layout)):
        index, hashes = layout(rng)
        report(name, index, hashes, block_hashes(NS, tokens(rng, PROMPT_TOKENS), PAGE))


if __name__ == "__main__":
    main()
