"""Page-locked host memory on exactly the bytes asked for (``cudaHostRegister``): the host
tier's slots (``teraio.core.tiers.host``), the SSD tier's bounce buffers
(``teraio.core.tiers.ssd``) and the pager's buffers (``teraio.core.pager``).
"""
from __future__ import annotations

import torch


def page_lock(buf: torch.Tensor, what: str) -> None:
    """Page-lock the host tensor ``buf`` on exactly its bytes (``cudaHostRegister``, portable);
    no-op for an empty one. Undo with :func:`page_unlock` before ``buf`` is freed.

    Raises:
        RuntimeError: the driver refused, naming ``what`` and the CUDA error.
    """
    if buf.numel():
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 1)  # 1: Portable
        if int(err) != 0:
            raise RuntimeError(f"{what}: cudaHostRegister of {buf.numel()} bytes failed (cudaError {int(err)})")


def pinned_empty(nbytes: int, what: str) -> torch.Tensor:
    """A page-locked CPU ``uint8`` tensor of ``nbytes`` (contents zero), owned by the caller
    (:func:`page_unlock` it before it is freed). Its pages are touched first by a
    multi-threaded fill, then locked: on an H200 host that made fresh memory usable at
    about 4.6 GB/s, against 1.6-2.0 GB/s for ``pin_memory=True`` or locking untouched pages,
    whose faults the driver takes one thread at a time
    (``benchmarks/results/host_pinning_h200.json``).

    Raises:
        RuntimeError: the driver refused, naming ``what``.
    """
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.fill_(0)
    page_lock(buf, what)
    return buf


def page_unlock(buf: torch.Tensor) -> None:
    """Undo :func:`page_lock`."""
    if buf.numel():
        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
