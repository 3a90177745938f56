"""Storage tiers behind the radix index: where a cached block's bytes live.

- `dram_shm`: L2, a slab pool in POSIX shared memory; one slot holds one block (all layers' K and V of one page).
  kvcached owns the pool and its free list; workers attach and copy blocks in and out of slots.
- L3 (LMDB on local disk) joins here in a later issue, behind the same allocate/free/read/write shape.
"""
