"""What kvcached knows of its disk tier (L3), and the write policy that decides which blocks go there.

Called on the daemon's event-loop thread only, like `KVCache`. L3 keys are chained block hashes, so the index of L3
is a plain set: a prompt's L3 run after its L2 prefix is the count of consecutive hashes in it (a gap ends it).
Blocks of a namespace that is not registered can never match: their hashes commit to another fingerprint.

Write policies (`--write-policy`), all asynchronous (`DiskTier.put_async` queues the block and returns at once):
- write_through: every committed block;
- write_through_selective: a block once it has been hit twice by MatchPrefix;
- write_back: a block when it is evicted from L2 (its bytes are copied out before the slot is reused).
Each queues the slot itself (`SlotSource`), which the disk writer copies from: for the first two the event loop
copies nothing (copying a committed prompt's blocks out here held it 26 ms per 64 blocks, 1.8 GB/s into fresh
memory, delaying the MatchPrefix calls behind it). A block leaving L2 before the writer reaches it, and every
write-back block, is copied out at its eviction (`SlotSource.freeze`), so it still reaches L3; a slot reused by any
other path is a dropped write (the seqlock).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvcached.tiers.dram_shm import SlabPool
from kvcached.tiers.lmdb_tier import ROOT_PARENT, DiskTier, EventKind, copy_bytes
from radixserve.blocks.keys import BlockHash
from radixserve.blocks.radix import EvictedBlock
from radixserve.config import Choice

log = logging.getLogger("kvcached.l3")

SELECTIVE_HITS = 2  # hits before write_through_selective stores a block: once is chance, twice is a pattern


class WritePolicy(Choice):
    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"


class SlotSource:
    """An L2 slot's bytes as the disk writer finds them: the block's only while the slot keeps the generation and key
    it had when the write was queued. The generation is read again after the copy (the slab's seqlock), so a slot
    reallocated meanwhile voids the copy, unless `freeze` (event loop, at the block's eviction, before the slot is
    freed) copied the bytes out first: then they are used. `copy_into` runs on the writer's thread."""

    def __init__(self, pool: SlabPool, slot: int, block_hash: BlockHash) -> None:
        self._pool, self._slot, self._key = pool, slot, bytes(block_hash)
        self._generation = pool.generation(slot)
        self._frozen: bytes | None = None
        self.nbytes = pool.slot_bytes

    def freeze(self) -> None:
        """Copies the slot's bytes out now: the slot is about to be reused."""
        if self._frozen is None and self._intact():
            self._frozen = bytes(self._pool.view(self._slot))

    def copy_into(self, out: memoryview) -> bool:
        if self._frozen is None and self._intact():
            with self._pool.view(self._slot) as slot:
                copy_bytes(out, slot)
            if self._pool.generation(self._slot) == self._generation:
                return True
        frozen = self._frozen  # set before the slot could be reused, so read after the generation moved
        if frozen is None:
            return False
        copy_bytes(out, frozen)
        return True

    def _intact(self) -> bool:
        header = self._pool.segment.header(self._slot)
        return header.generation == self._generation and header.key == self._key


class L3:
    def __init__(self, disk: DiskTier, policy: WritePolicy):
        self.disk = disk
        self.policy = policy
        self._blocks: set[BlockHash] = {meta.hash for meta in disk.scan()}
        self._hits: dict[BlockHash, int] = {}
        self._queued: dict[BlockHash, SlotSource] = {}  # blocks the writer has not stored or dropped yet
        self.unverified_blocks = 0  # slots whose header did not name the block about to be stored
        log.info("disk tier open", extra={"blocks": len(self._blocks), "write_policy": policy.value})

    def __len__(self) -> int:
        return len(self._blocks)

    def refresh(self) -> None:
        """Applies the tier's evictions, corrupt-block deletions and namespace drops to the set."""
        for event in self.disk.take_events():
            self._queued.pop(event.block_hash, None)
            if event.kind is EventKind.REMOVED:
                self._blocks.discard(event.block_hash)
                self._hits.pop(event.block_hash, None)

    def run_length(self, hashes: Sequence[BlockHash], start: int) -> int:
        """How many of hashes[start:] are in L3, consecutively from `start`; 0 while the tier is unhealthy."""
        if not self.disk.healthy:
            return 0
        end = start
        while end < len(hashes) and hashes[end] in self._blocks:
            end += 1
        return end - start

    # -- write policies ----------------------------------------------------------------------------------------
    def committed(self, namespace: str, pool: SlabPool, hashes: Sequence[BlockHash], first: int,
                  slots: Sequence[int]) -> None:
        """Pages hashes[first:first+len(slots)] were just committed into `slots`."""
        self.disk.note_request()
        if self.policy is WritePolicy.WRITE_THROUGH:
            for i, slot in enumerate(slots, start=first):
                self._store(namespace, pool, hashes[i], hashes[i - 1] if i else None, slot)

    def hit(self, namespace: str, pool: SlabPool, hashes: Sequence[BlockHash], slots: Sequence[int]) -> None:
        """MatchPrefix found hashes[:len(slots)] in L2 (none, for a miss)."""
        self.disk.note_request()
        if self.policy is not WritePolicy.WRITE_THROUGH_SELECTIVE:
            return
        for i, slot in enumerate(slots):
            count = self._hits.get(hashes[i], 0) + 1
            self._hits[hashes[i]] = count
            if count == SELECTIVE_HITS:
                self._store(namespace, pool, hashes[i], hashes[i - 1] if i else None, slot)

    def evicted(self, namespace: str, pool: SlabPool, blocks: Sequence[EvictedBlock]) -> None:
        """`blocks` leave L2; their slots are still intact. A queued block among them, and every write-back block, now
        waits for the writer in memory only: the writer is urged off idle cores (`DiskTier.urge`)."""
        orphaned = False
        for block in blocks:
            if queued := self._queued.pop(block.block_hash, None):
                queued.freeze()  # its slot is reused next: the writer copies these bytes instead
                orphaned = True
            if self.policy is WritePolicy.WRITE_BACK:
                orphaned |= self._store(namespace, pool, block.block_hash, block.parent_hash, block.slot, evicting=True)
            self._hits.pop(block.block_hash, None)
        if orphaned:
            self.disk.urge()

    def _store(self, namespace: str, pool: SlabPool, block_hash: BlockHash, parent: BlockHash | None,
               slot: int, evicting: bool = False) -> bool:
        """Queues the block for L3 unless it is there already or its slot does not vouch for it; whether it queued."""
        if block_hash in self._blocks or not self.disk.healthy:
            return False
        if pool.segment.header(slot).key != block_hash:  # only bytes the index vouches for become durable
            self.unverified_blocks += 1
            log.error("a slot's header does not name the block stored from it; not writing it to L3",
                      extra={"slot": slot, "block": block_hash.hex()})
            return False
        # Counted as stored at once: a read that races the writer is a miss, and a miss only costs a recompute.
        source = SlotSource(pool, slot, block_hash)
        if evicting:  # the slot is reused next
            source.freeze()
        if not self.disk.put_async(namespace, block_hash, parent or ROOT_PARENT, source):
            return False
        self._blocks.add(block_hash)
        self._queued[block_hash] = source
        return True
