"""The vocabulary every radixserve process agrees on for cache blocks.

A block is all layers' K and V of one page of `page_size` tokens. The router, kvcached and the model workers meet
only through `protos/`, and they must agree on four things, which live here and nowhere else:
- `keys`: the chained block key of each full page of a prompt (model fingerprint + cache salt + every token);
- `radix`: the radix index over those keys (kvcached's L2 index, a worker's L1 index);
- `geometry`: the block's shape, byte size and page-first layout;
- `slab`: the attach side of kvcached's shared-memory slab segment (kvcached alone creates, frees and unlinks).
Pure Python: no gRPC, no torch; only `slab` maps memory.
"""
