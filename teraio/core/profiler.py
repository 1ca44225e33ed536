"""Tensor lifetime profiler (paper §3.1).

The paper instruments PyTorch's operator codegen so that every generated operator marks its
inputs and outputs active. We get the same view without patching PyTorch: a
``TorchDispatchMode`` sees every aten op of the whole training step (forward, backward,
optimizer step; autograd propagates the mode to its worker threads), with the real tensors
below autograd.

Identity. A storage is keyed by its ``StorageImpl`` address (``untyped_storage()._cdata``),
never ``data_ptr()`` alone, and an op output whose storage is not among the op's inputs is a
*fresh allocation*: it opens a new record even if the address was seen before (the old
storage died and the allocator reused its ``StorageImpl`` slot). Outputs that alias an
input (views, in-place ops) extend the input's record. Persistent tensors (parameters,
buffers, optimizer state) are registered by name before the step, so their ids are stable
across iterations; an intermediate is named after the op and output slot that allocated
it (``op<k>:out<j>``), which the engine matches in later iterations.

Every op is a use of every storage it touches, views included: a view of a storage that
has been freed with ``resize_(0)`` fails its bounds check, so views need residency too.
"""
from __future__ import annotations

import time
from typing import Callable, Iterator

import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from teraio.core.trace import TensorRecord, Trace


def iter_tensors(args: tuple, kwargs: dict | None) -> Iterator[torch.Tensor]:
    """Tensors among an aten op's arguments (top level and one list level deep, which is
    every aten schema's nesting). Faster than a general pytree flatten on the hot path."""
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, torch.Tensor):
                    yield x
    if kwargs:
        yield from iter_tensors(tuple(kwargs.values()), None)


def storage_id(s: torch.UntypedStorage) -> int:
    """Identity of a storage: its StorageImpl address, which ``resize_`` keeps."""
    return s._cdata


def storage_key(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage (:func:`storage_id`)."""
    return storage_id(t.untyped_storage())


def fresh_outputs(out, in_keys: set[int]) -> list[torch.Tensor]:
    """The outputs of an op that live in newly allocated storages, in output order (their
    position is the ``out<j>`` slot of the intermediate's name). Outputs that alias an input
    (views, in-place results) are not fresh."""
    outs = (out,) if isinstance(out, torch.Tensor) else (tuple(out) if isinstance(out, (list, tuple)) else ())
    fresh, seen = [], set(in_keys)
    for t in iter_tensors(outs, None):
        key = storage_key(t)
        if key not in seen:
            seen.add(key)
            fresh.append(t)
    return fresh


def persistent_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Name -> tensor for every parameter, buffer and optimizer-state tensor (stable names:
    ``param:<fqn>``, ``buffer:<fqn>``, ``optim:<fqn>:<state key>``). Tied parameters appear
    once, under their first name."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    names = {}
    for fqn, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out[f"param:{fqn}"] = p
            names[id(p)] = fqn
    for fqn, b in model.named_buffers():
        out[f"buffer:{fqn}"] = b
    for p, state in optimizer.state.items():
        for key, v in state.items():
            if isinstance(v, torch.Tensor):
                out[f"optim:{names.get(id(p), id(p))}:{key}"] = v
    return out


class _Rec:
    __slots__ = ("name", "nbytes", "kind", "persistent", "uses")

    def __init__(self, name: str, nbytes: int, kind: str, persistent: bool):
        self.name, self.nbytes, self.kind, self.persistent = name, nbytes, kind, persistent
        self.uses: list[int] = []


class LifetimeProfiler(TorchDispatchMode):
    """Records one training iteration into a :class:`Trace`. Use :func:`profile_step`."""

    def __init__(self, persistent: dict[str, torch.Tensor], device: torch.device, pager=None):
        super().__init__()
        self.device = device
        self.pager = pager
        self.records: list[_Rec] = []
        self.by_key: dict[int, _Rec] = {}
        self.op_names: list[str] = []
        self.op_seconds: list[float] = []
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.op_in_backward: list[bool] = []
        self.op_allocated: list[int] = []  # CUDA: allocator peak during each op, bytes
        self.peak_allocated = 0  # CUDA: the allocator's peak over the step (it is reset per op)
        for name, t in persistent.items():
            kind = "optim" if name.startswith("optim:") else "param"
            storage = t.untyped_storage()
            rec = _Rec(name, pager.nbytes(storage) if pager else storage.nbytes(), kind, persistent=True)
            self.records.append(rec)
            self.by_key[storage_key(t)] = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        k = len(self.op_names)
        pager = self.pager
        if pager is not None:  # what op k touches is resident from here on
            pager.admit(func, args, kwargs)
        in_keys = set()
        for t in iter_tensors(args, kwargs):
            key = storage_key(t)
            in_keys.add(key)
            rec = self.by_key.get(key)
            if rec is None:  # created outside the step (e.g. the token batch)
                rec = _Rec(f"input:{len(self.records)}", t.untyped_storage().nbytes(), "input", False)
                self.records.append(rec)
                self.by_key[key] = rec
            if not rec.uses or rec.uses[-1] != k:
                rec.uses.append(k)
        self.op_in_backward.append(torch._C._current_graph_task_id() != -1)
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

            def run():
                torch.cuda.reset_peak_memory_stats(self.device)
                start.record()
                out = func(*args, **(kwargs or {}))
                end.record()
                return out
            out = run() if pager is None else pager.run(run, in_keys)
            allocated = torch.cuda.max_memory_allocated(self.device)
            self.peak_allocated = max(self.peak_allocated, allocated)
            # Un-offloaded, the storages the pager holds off the device would be allocated too.
            self.op_allocated.append(allocated + (pager.evicted_bytes if pager is not None else 0))
            self._events.append((start, end))
            self.op_seconds.append(0.0)
        else:
            t0 = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            self.op_seconds.append(time.perf_counter() - t0)
        if pager is not None:
            pager.settle(out, in_keys)
        self.op_names.append(str(func))

        for slot, t in enumerate(fresh_outputs(out, in_keys)):
            rec = _Rec(f"op{k}:out{slot}", t.untyped_storage().nbytes(), "temp", False)
            rec.uses.append(k)
            self.records.append(rec)
            self.by_key[storage_key(t)] = rec
        return out

    def trace(self, grad_keys: set[int], meta: dict) -> Trace:
        """Finish: resolve CUDA timings and tensor kinds, and build the :class:`Trace`.

        ``grad_keys``: storage keys of the gradients seen just before the optimizer step.
        """
        if self._events:
            torch.cuda.synchronize(self.device)
            self.op_seconds = [s.elapsed_time(e) / 1e3 for s, e in self._events]
        grad_recs = {id(self.by_key[k]) for k in grad_keys if k in self.by_key}
        in_bwd = self.op_in_backward
        tensors = []
        for rec in self.records:
            if not rec.uses:
                continue  # registered (e.g. an unused buffer) but never touched this step
            kind = rec.kind
            if id(rec) in grad_recs:
                kind = "grad"
            elif kind == "temp" and not in_bwd[rec.uses[0]] and any(in_bwd[u] for u in rec.uses):
                kind = "activation"  # made outside backward, read by it: saved for backward
            tensors.append(TensorRecord(tid=len(tensors), name=rec.name, nbytes=rec.nbytes, kind=kind,
                                        persistent=rec.persistent, uses=list(rec.uses)))
        return Trace(op_names=self.op_names, op_seconds=np.asarray(self.op_seconds), tensors=tensors,
                     meta=meta, op_allocated_bytes=self.op_allocated or None)


def profile_step(step_fn: Callable[[], float], model: nn.Module, optimizer: torch.optim.Optimizer,
                 device: torch.device, meta: dict | None = None, pager=None) -> tuple[float, Trace]:
    """Run ``step_fn`` (one whole training step) under the profiler.

    Call it after at least one step, so that the optimizer state exists and is profiled
    as persistent (paper §3.1: the profile stands for every later iteration). The trace's
    ``meta["optimizer_ops"]`` is ``[first, end)``, the ops of ``optimizer.step`` (from its
    pre- and post-step hooks).

    On CUDA the allocator's peak statistics are reset before each op; the step's own peak
    is ``meta["peak_allocated_bytes"]``.

    With a ``pager`` (``teraio.core.pager.Pager``) the step runs within the pager's capacity:
    each op's inputs are made resident and room is made for its outputs before the op's
    timing starts, so ``op_seconds`` are the kernels' own; on CUDA ``op_allocated_bytes``
    adds the bytes the pager holds off the device, so the trace describes the un-offloaded
    step all the same.

    Returns:
        (the step's return value, the :class:`Trace`).
    """
    grad_keys: set[int] = set()
    prof = LifetimeProfiler(persistent_tensors(model, optimizer), device, pager)
    optimizer_ops: list[int] = []  # [first op of optimizer.step, first op after it)

    def capture_grads(opt, args, kwargs):
        optimizer_ops[:] = [len(prof.op_names)]
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grad_keys.add(storage_key(p.grad))

    def mark_step_end(opt, args, kwargs):
        optimizer_ops.append(len(prof.op_names))

    handles = [optimizer.register_step_pre_hook(capture_grads), optimizer.register_step_post_hook(mark_step_end)]
    try:
        with prof:
            out = step_fn()
    finally:
        for h in handles:
            h.remove()
    return out, prof.trace(grad_keys, dict(meta or {}, device=str(device), optimizer_ops=optimizer_ops,
                                           peak_allocated_bytes=prof.peak_allocated or None))
