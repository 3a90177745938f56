"""Moving whole blocks between the worker's L1 pool and kvcached's shared memory, chosen once per device.

A block is one page of all layers, contiguous on both sides (page-first layout), so each move is one copy.
- CPU pool: one memmove per block. torch's `copy_` of a 0.7 MB block fans out over its thread pool and, with the
  cores busy decoding, waits for a second thread: measured 0.09 GB/s under load against 7-8 GB/s for a memmove.
  Copies are made when drained. Those a request waits for (L2 -> L1, before its forward, while the cores are
  otherwise idle) are shared with one helper thread, the two taking blocks in turn (a busy helper only leaves more
  to the caller): two threads move more bytes than one (87 MB of blocks, cold: 8-11 against 14-16 ms, Xeon VM).
  Commits (L1 -> L2) run beside the forward, on the caller alone: a second copying thread would take the other core
  from the forward's OpenMP team.
- CUDA pool: the shared-memory mapping is page-locked (`cudaHostRegister`) once per attach, so copies are true
  asynchronous DMA on a side stream; `drain()` waits on the host until they are complete: before a block copied into
  L1 is verified against its slot's header, and before a block copied out of the GPU is committed.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from radixserve.blocks.geometry import BlockGeometry
from radixserve.blocks.slab import SlabSegment

log = logging.getLogger("model_worker.block_copy")


def slab_blocks(segment: SlabSegment, geometry: BlockGeometry) -> torch.Tensor:
    """The segment's slots as blocks [num_slots, *geometry.block_shape], a view of the shared memory (it pins the
    mapping until dropped: see `SlabSegment.close`)."""
    dtype = getattr(torch, geometry.dtype)
    return torch.frombuffer(segment.buffer, dtype=dtype).view(segment.num_slots, *geometry.block_shape)


class HostBlockCopy:
    """Block copies between host tensors, issued and drained by one thread. `helper`: `drain` shares them with a
    helper thread."""

    def __init__(self, helper: bool = False) -> None:
        self._issued: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="block-copy") if helper else None

    def pin(self, host: torch.Tensor) -> None:
        """Prepares a shared-memory mapping for fast copies; a no-op here."""

    def unpin(self, host: torch.Tensor) -> None:
        """Undoes `pin` before the mapping is closed; a no-op here."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Issues the copy of contiguous `src` into contiguous `dst` (the same size); it is made by `drain`. The
        pair is held until then, and so the mapping it views."""
        self._issued.append((dst, src))

    def drain(self) -> None:
        """Makes the copies issued since the last drain, and returns when they are complete."""
        pairs, self._issued = self._issued, []
        if self._helper is None or len(pairs) < 2:
            for dst, src in pairs:
                _move(dst, src)
            return
        lock, taken = threading.Lock(), iter(pairs)

        def take_in_turn() -> None:
            while True:
                with lock:
                    pair = next(taken, None)
                if pair is None:
                    return
                _move(*pair)

        helper = self._helper.submit(take_in_turn)
        take_in_turn()
        helper.result()


def _move(dst: torch.Tensor, src: torch.Tensor) -> None:
    """One memmove (ctypes releases the GIL during it)."""
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())


class CudaBlockCopy(HostBlockCopy):
    def __init__(self, device: torch.device):
        super().__init__(helper=False)
        self._stream = torch.cuda.Stream(device)

    def pin(self, host: torch.Tensor) -> None:
        code = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel() * host.element_size(), 0)
        if int(code) != 0:  # copies still work from pageable memory, only slower and synchronous
            log.warning("cudaHostRegister failed; L2 copies will not overlap compute", extra={"code": int(code)})

    def unpin(self, host: torch.Tensor) -> None:
        torch.cuda.cudart().cudaHostUnregister(host.data_ptr())

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)


    def drain(self) -> None:
        self._stream.synchronize()


def block_copy_for(device: torch.device, waited_for: bool = False) -> HostBlockCopy:
    """The copier for a pool on `device`; `waited_for`: for copies a request waits for (on the CPU, shared with a
    helper thread)."""
    return CudaBlockCopy(device) if device.type == "cuda" else HostBlockCopy(helper=waited_for)
