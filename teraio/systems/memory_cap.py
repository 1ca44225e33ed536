"""The emulated GPU capacity: a device of ``hardware.gpu_capacity_bytes`` on a larger GPU.

Two ways to hold a run to the capacity (``hardware.capacity_mode``), applied by
:func:`apply_memory_cap` before a system's first device allocation and lifted by
:meth:`MemoryCap.lift` after training (restoring offloaded tensors at close can need more):

* ``fraction`` (PyTorch's ``torch.cuda.set_per_process_memory_fraction``): the caching
  allocator refuses to reserve past the capacity. It checks each request whole against what it
  has reserved, before it looks at its pages: with expandable segments, a request that could
  grow a free block already mapped by the part it lacks is refused when the whole request does
  not fit beside what is reserved, and the allocator then releases all its unused memory (a
  device sync) and tries again.
* ``reserve``: the device's memory past the capacity is taken up front, outside the caching
  allocator (``cuMemAlloc``, the *ballast*), and the allocator runs uncapped in what is left,
  as on a GPU of that size: it maps only the pages a request lacks, and releases its unused
  memory when the device has no pages left. Memory that is not the allocator's and grows during
  the run (CUDA's lazily loaded kernels, library handles) comes out of the capacity, as it
  does on a GPU of that size. The allocator's ``garbage_collection_threshold`` setting, which
  PyTorch applies only under a fraction, does nothing here.

Which one holds a run is in its config; every system of a comparison is held the same way.
Measured side by side on an H100 (TeraIO-Mixed at the Llama3-8B cut's ``seq_short`` point,
``runs/reference/h100/allocator_settings/capacity_mode/``), the two made the same 6-7 retries
per step and the same tokens/s within the trials' spread: under either mode the cache there
held memory a gigabyte-sized request could not use, free but not in one piece or still waiting
on an offload's copy (``teraio.core.pending``).
"""
from __future__ import annotations

import ctypes

import torch

from teraio.config import check_capacity_mode


def ballast_bytes(capacity_bytes: int, free_bytes: int, reserved_bytes: int) -> int:
    """Bytes to take outside the caching allocator so that it can hold at most
    ``capacity_bytes`` in all: the device's ``free_bytes`` less what the allocator may still
    add to its ``reserved_bytes``; 0 where the device has no more free than that.

    Raises:
        ValueError: the allocator already holds more than the capacity.
    """
    if reserved_bytes > capacity_bytes:
        raise ValueError(f"hardware.capacity_mode=reserve: the caching allocator already holds {reserved_bytes} "
                         f"bytes, more than the capacity hardware.gpu_capacity_bytes={capacity_bytes}")
    return max(0, free_bytes - (capacity_bytes - reserved_bytes))


class _Driver:
    """``cuMemAlloc``/``cuMemFree`` of the CUDA driver (``libcuda.so.1``), in the context
    PyTorch made current on the device."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")

    def alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_uint64(0)
        rc = self.lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes))
        if rc != 0:
            raise RuntimeError(f"hardware.capacity_mode=reserve: cuMemAlloc of the {nbytes}-byte ballast "
                               f"failed (CUresult {rc})")
        return ptr.value

    def free(self, ptr: int) -> None:
        rc = self.lib.cuMemFree_v2(ctypes.c_uint64(ptr))
        if rc != 0:
            raise RuntimeError(f"cuMemFree of the ballast at {ptr:#x} failed (CUresult {rc})")


class MemoryCap:
    """A capacity applied to a device by :func:`apply_memory_cap`, until :meth:`lift`.

    Attributes:
        mode: ``"fraction"``, ``"reserve"``, or None where nothing was applied (no
            capacity, or a CPU device) and once lifted.
        ballast_bytes: the bytes taken outside the allocator (``reserve``; 0 where the device
            had no more free than the capacity), else 0.
    """

    def __init__(self, device: torch.device, mode: str | None, ballast: tuple[_Driver, int] | None = None,
                 ballast_bytes: int = 0):
        self.device, self.mode, self.ballast_bytes = device, mode, ballast_bytes
        self._ballast = ballast

    def lift(self) -> None:
        """Give the device back whole: the fraction back to 1, the ballast freed. Idempotent."""
        if self.mode == "fraction":
            torch.cuda.set_per_process_memory_fraction(1.0, _index(self.device))
        elif self._ballast is not None:
            driver, ptr = self._ballast
            self._ballast = None
            with torch.cuda.device(self.device):
                torch.cuda.synchronize(self.device)
                driver.free(ptr)
        self.mode = None


def capacity_unenforced(capacity_bytes: int | None, device: torch.device) -> bool:
    """Whether a run asked to be held to ``capacity_bytes`` gets nothing that holds it: the
    cap binds CUDA's caching allocator only, so on another device :func:`apply_memory_cap`
    applies nothing (its row says ``capacity_enforced: false``; ``analysis.tables`` names it)."""
    return capacity_bytes is not None and device.type != "cuda"


def apply_memory_cap(capacity_bytes: int | None, device: torch.device, mode: str) -> MemoryCap:
    """Hold ``device`` to ``capacity_bytes`` (bytes) the ``mode`` way (module docstring): past
    it allocations raise ``torch.OutOfMemoryError`` as on a smaller GPU. Nothing is applied for
    None or a CPU device (a cap whose :meth:`MemoryCap.lift` does nothing). ``reserve`` first
    releases the allocator's unused memory (a device sync), so that only what is live counts.

    Raises:
        ValueError: a capacity larger than the GPU's total memory or not positive, an unknown
            mode, or (``reserve``) live memory already past the capacity.
        OSError: (``reserve``) no CUDA driver library (``libcuda.so.1``).
        RuntimeError: (``reserve``) the driver could not allocate the ballast.
    """
    check_capacity_mode(mode)
    if capacity_bytes is None or device.type != "cuda":
        return MemoryCap(device, None)
    total = torch.cuda.get_device_properties(device).total_memory
    if not 0 < capacity_bytes <= total:
        raise ValueError(f"hardware.gpu_capacity_bytes={capacity_bytes} must be in (0, {total}] "
                         f"(the total memory of {torch.cuda.get_device_name(device)})")
    if mode == "fraction":
        torch.cuda.set_per_process_memory_fraction(capacity_bytes / total, _index(device))
        return MemoryCap(device, mode)
    with torch.cuda.device(device):
        torch.cuda.synchronize(device)  # the primary context current on this thread
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        nbytes = ballast_bytes(capacity_bytes, free, torch.cuda.memory_reserved(device))
        if nbytes == 0:
            return MemoryCap(device, mode)
        driver = _Driver()
        return MemoryCap(device, mode, (driver, driver.alloc(nbytes)), nbytes)


def _index(device: torch.device) -> int:
    # set_per_process_memory_fraction rejects a device without an index ("cuda").
    return device.index if device.index is not None else torch.cuda.current_device()
