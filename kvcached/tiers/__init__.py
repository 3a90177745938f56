"""Storage tiers behind the radix index: where a cached block's bytes live.

- `dram_shm`: L2, a slab pool in POSIX shared memory; one slot holds one block (all layers' K and V of one page).
  kvcached owns the pool and its free list; workers attach (`radixserve.blocks.slab`) and copy blocks in and out.
- `lmdb_tier`: L3, a size-bounded LRU block store in one LMDB environment on local disk, written by its own
  thread; its headers (namespace, parent hash) let the daemon rebuild the index after a restart.
"""
