"""Recompute chains: what it takes to make a tensor of a :class:`~teraio.core.trace.Trace`
again just before a later use, from tensors that are resident then (DTR-style
rematerialization, the third option of ``teraio.core.planner`` beside the SSD and host tiers).

A trace records, per storage, the ops that touch it. The op that first touches a
non-persistent storage made during the step (``uses[0]``) produced it (the trace names it
``op<k>:out<j>``); every other storage an op touches is one of its inputs. To recompute a
tensor X before op b, its producer runs again; each of the producer's inputs is either
*resident* at b (a persistent tensor, or an intermediate whose last use is b or later) or
is itself recomputed first, recursively, up to ``max_ops`` ops. The attention
probabilities of an SDPA math kernel are the case this serves: ``_safe_softmax`` of
``add(bmm(q, k), mask)``, each a few ms, from q, k and the mask that stay resident.

A chain is refused (not *recomputable*) where re-running it might not give the same bytes:
an op that draws random numbers, allocates without writing (``empty``), writes in place or
into an ``out=`` argument, is a collective, or is not a registered op at all; or where a
tensor of the chain (a recomputed one or a resident input) is written in place by another
op between its producer and b.

Random ops are told from PyTorch's own metadata, not their names (:func:`draws_random`):
``rrelu_with_noise``, ``poisson`` or ``binomial`` name no distribution a pattern would catch.
The fused attention kernels (``_scaled_dot_product_flash_attention_for_cpu``, the CUDA
flash, efficient and cuDNN ones) carry the tag because of their ``dropout_p`` argument; a
trace records op names, not arguments, so they are refused even where ``dropout_p`` was 0.
On CUDA in FP32 the math kernel runs (``teraio.workload.models.attention_bytes``), whose
ops (``bmm``, ``_safe_softmax``) are untagged, so the refusal costs the CPU kernel only.
"""
from __future__ import annotations

import bisect
import dataclasses
import re

import numpy as np
import torch

from teraio.core.trace import Trace

# Ops, beside random ones (:func:`draws_random`), whose outputs a re-run might not reproduce
# bit for bit (uninitialised memory), or that write their arguments or touch other ranks.
_IMPURE = re.compile(r"empty|c10d|_foreach|copy_")


def is_inplace(op_name: str) -> bool:
    """Whether ``op_name`` (``"aten.add_.Tensor"``) writes one of its arguments: an in-place
    variant (base name ending in ``_``, not a dunder such as ``__and__``) or an ``out=``
    overload."""
    parts = op_name.split(".")
    base = parts[1] if len(parts) > 1 else parts[0]
    overload = parts[2] if len(parts) > 2 else ""
    return (base.endswith("_") and not base.startswith("__")) or overload.startswith("out")


def out_variant(op_name: str):
    """The ``out=`` overload of the aten op ``op_name`` (``"aten.mul.Tensor"`` ->
    ``aten.mul.out``) where it takes the same arguments plus one ``out`` tensor and returns
    one tensor; None otherwise (``_safe_softmax`` has none). A chain's last op re-runs through
    it straight into the dropped tensor's storage (``teraio.core.rerun``)."""
    parts = op_name.split(".")
    if len(parts) != 3 or parts[0] != "aten":
        return None
    packet = getattr(torch.ops.aten, parts[1], None)
    name = "out" if parts[2] in ("default", "Tensor") else f"{parts[2]}_out"
    try:
        functional, out = getattr(packet, parts[2]), getattr(packet, name)
    except AttributeError:
        return None
    outs = [a.name for a in out._schema.arguments if a.is_out]
    same = ([(a.name, str(a.type)) for a in functional._schema.arguments]
            == [(a.name, str(a.type)) for a in out._schema.arguments if not a.is_out])
    single = len(functional._schema.returns) == 1 and str(functional._schema.returns[0].type) == "Tensor"
    return out if outs == ["out"] and same and single else None


def op_overload(op_name: str):
    """The ``torch.ops`` overload that ``op_name`` (``"aten.add.Tensor"``, as the profiler
    writes ``str(func)``) names; None where it names none."""
    parts = op_name.split(".")
    if len(parts) != 3:
        return None
    try:
        return getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
    except (AttributeError, RuntimeError):
        return None


def draws_random(op) -> bool:
    """Whether the op overload ``op`` may draw random numbers, by PyTorch's own metadata: it
    is tagged ``nondeterministic_seeded`` or takes a ``Generator`` argument (the tag alone
    misses a few, such as ``_no_grad_normal_``)."""
    return (torch.Tag.nondeterministic_seeded in op.tags
            or any("Generator" in str(a.type) for a in op._schema.arguments))


def is_pure(op_name: str) -> bool:
    """Whether re-running ``op_name`` on the same inputs makes the same outputs and writes
    nothing else (see the module docstring): a registered op, not in place, not random
    (:func:`draws_random`), not an allocation, collective or ``_foreach`` op."""
    op = op_overload(op_name)
    return (op is not None and not is_inplace(op_name) and not draws_random(op)
            and not _IMPURE.search(op_name))


@dataclasses.dataclass
class Chain:
    """How to make one tensor again before op ``needed_by``.

    Attributes:
        ops: the op indices to re-run, ascending.
        inputs: tids of the resident tensors they read.
        seconds: the ops' profiled seconds in all.
        extra_bytes: the most bytes the re-run holds at once beyond the tensor itself (at
            least the tensor's own bytes where the engine copies a fresh result into its
            storage: the last op has no ``out=`` variant, :func:`out_variant`).
    """

    ops: list[int]
    inputs: list[int]
    seconds: float
    extra_bytes: int


class Chains:
    """Recompute chains of a trace's tensors (module docstring).

    Args:
        trace: the profiled iteration.
        max_ops: longest chain, in producing ops.
    """

    def __init__(self, trace: Trace, max_ops: int = 8):
        self.trace = trace
        self.max_ops = max_ops
        # per op, the tensors it makes and those it reads, in tensor order: one flat list each
        # with each op's start in it (few objects for the collector, however long the trace)
        ops: tuple[list[int], list[int]] = ([], [])
        tids: tuple[list[int], list[int]] = ([], [])
        for t in trace.tensors:
            made_here = not t.persistent and t.kind != "input"
            for j, u in enumerate(t.uses):
                out = int(not (made_here and j == 0))
                ops[out].append(u)
                tids[out].append(t.tid)
        self._tids, self._start = [], []
        for op, tid in zip(ops, tids):
            order = np.argsort(np.asarray(op, dtype=np.int64), kind="stable")
            self._tids.append(np.asarray(tid, dtype=np.int64)[order].tolist())
            self._start.append(np.searchsorted(np.asarray(op, dtype=np.int64)[order],
                                               np.arange(trace.n_ops + 1)).tolist())
        kinds = {o: (is_pure(o), is_inplace(o)) for o in set(trace.op_names)}
        self.pure = np.array([kinds[o][0] for o in trace.op_names], dtype=bool)
        self.inplace = np.array([kinds[o][1] for o in trace.op_names], dtype=bool)
        self._out: dict[str, bool] = {}  # op name -> it has an out= variant
        # per tensor, its uses by in-place ops, ascending
        self._written: dict[int, list[int]] = {}
        for t in trace.tensors:
            w = [u for u in t.uses if self.inplace[u]]
            if w:
                self._written[t.tid] = sorted(w)

    def outputs(self, k: int) -> list[int]:
        """The tensors op ``k`` makes (the first use of a non-persistent one made in the
        step), in tensor order."""
        return self._tids[0][self._start[0][k]:self._start[0][k + 1]]

    def inputs(self, k: int) -> list[int]:
        """The tensors op ``k`` touches and does not make, in tensor order."""
        return self._tids[1][self._start[1][k]:self._start[1][k + 1]]

    def _has_out_variant(self, op_name: str) -> bool:
        """Whether :func:`out_variant` finds one for ``op_name``, asked once per op name."""
        if op_name not in self._out:
            self._out[op_name] = out_variant(op_name) is not None
        return self._out[op_name]

    def _written_between(self, tid: int, lo: int, hi: int) -> bool:
        """Whether an in-place op touches tensor ``tid`` at an op in ``(lo, hi)``."""
        w = self._written.get(tid)
        if not w:
            return False
        i = bisect.bisect_right(w, lo)
        return i < len(w) and w[i] < hi

    def chain(self, tid: int, needed_by: int) -> Chain | None:
        """The chain that makes tensor ``tid`` again just before op ``needed_by``; None if it
        is not recomputable (module docstring) or longer than ``max_ops`` ops.

        Raises:
            ValueError: ``needed_by`` is not after the tensor's producer.
        """
        tensors = self.trace.tensors
        x = tensors[tid]
        if x.persistent or x.kind == "input":
            return None
        if needed_by <= x.uses[0]:
            raise ValueError(f"needed_by={needed_by} is not after the producer (op {x.uses[0]}) of {x.name!r}")
        made: set[int] = set()
        resident: set[int] = set()
        ops: set[int] = set()
        stack = [tid]
        while stack:
            t = stack.pop()
            if t in made:
                continue
            rec = tensors[t]
            if rec.persistent or rec.kind == "input":
                return None
            k = rec.uses[0]
            if not self.pure[k] or self._written_between(t, k, needed_by):
                return None
            ops.add(k)
            if len(ops) > self.max_ops:
                return None
            made.update(self.outputs(k))
            for i in self.inputs(k):
                if i in made or i in resident:
                    continue
                r = tensors[i]
                if r.persistent or r.kind == "input" or r.uses[-1] >= needed_by:
                    if self._written_between(i, k, needed_by):
                        return None
                    resident.add(i)
                else:
                    stack.append(i)
        order = sorted(ops)
        # Bytes alive during the re-run: each op's outputs appear; a made tensor other than
        # the target goes after the last chain op that reads it.
        last_read = {}
        for k in order:
            for i in self.inputs(k):
                if i in made:
                    last_read[i] = k
        alive = peak = 0
        for k in order:
            alive += sum(tensors[o].nbytes for o in self.outputs(k))
            peak = max(peak, alive)
            for o in made:
                if o != tid and last_read.get(o, tensors[o].uses[0]) == k:
                    alive -= tensors[o].nbytes
        # The engine re-runs the chain's last op into the tensor's own storage where the op
        # has an out= variant; else into fresh memory, then copies (``teraio.core.rerun``):
        # the tensor's bytes twice at the copy.
        last = x.uses[0]
        copies = len(self.outputs(last)) != 1 or not self._has_out_variant(self.trace.op_names[last])
        return Chain(ops=order, inputs=sorted(resident),
                     seconds=float(self.trace.op_seconds[order].sum()),
                     extra_bytes=max(peak - x.nbytes, x.nbytes if copies else 0))
