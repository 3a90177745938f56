"""Moving whole blocks between the worker's L1 pool and kvcached's shared memory, chosen once per device.

A block is one page of all layers, contiguous on both sides (page-first layout), so each move is one copy.
- CPU pool: one memmove per block. torch's `copy_` of a 0.7 MB block fans out over its thread pool and, with the
  cores busy decoding, waits for a second thread: measured 0.09 GB/s under load against 7-8 GB/s for a memmove.
- CUDA pool: the shared-memory mapping is page-locked (`cudaHostRegister`) once per attach, so copies are true
  asynchronous DMA on a side stream; `drain()` waits on the host until they are complete: before a block copied into
  L1 is verified against its slot's header, and before a block copied out of the GPU is committed.
"""

from __future__ import annotations

import ctypes
import logging

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
    def pin(self, host: torch.Tensor) -> None:
        """Prepares a shared-memory mapping for fast copies; a no-op here."""

    def unpin(self, host: torch.Tensor) -> None:
        """Undoes `pin` before the mapping is closed; a no-op here."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())


    def drain(self) -> None:
        """Waits until the copies issued so far are complete; they already are here."""


class CudaBlockCopy(HostBlockCopy):
    def __init__(self, device: torch.device):
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


def block_copy_for(device: torch.device) -> HostBlockCopy:
    return CudaBlockCopy(device) if device.type == "cuda" else HostBlockCopy()
