"""Re-running a plan's recompute chains during training: the engine side of the planner's
third option (``teraio.core.recompute``, :class:`~teraio.core.plan.Recompute`).

Design: DTR-style rematerialization in the engine's ``TorchDispatchMode``, not selective
activation checkpointing. The engine already sees op k of every step as op k of the
profiled trace, so while a chain op runs in the forward pass it records the call (the aten
overload, its arguments, its keyword arguments); at the planned op it calls the same
overloads again on the same tensors, below autograd (a dispatch handler runs with the mode
off, so the re-run neither records a graph nor counts as a trace op). The last op writes
straight into the dropped tensor's own storage, allocated again, through its ``out=``
overload where it has one (``recompute.out_variant``: the same kernel); otherwise its result's
bytes are copied there (the tensor's bytes twice for a moment, which the plan counts). Checkpointing generated from the plan
(``torch.utils.checkpoint`` with a policy from ``create_selective_checkpoint_contexts``)
would instead re-run whole regions inside backward, adding ops the trace does not have
(the engine's op indices would no longer match) and re-running ops the plan keeps. The
re-run is bit-exact because only deterministic ops make a chain (``recompute.is_pure``),
their resident inputs are not written between the recording and the re-run (the planner's
rule), and they run on the same device with the same arguments.

What a record holds for each tensor argument of a chain op: the tensor itself where it is
a *resident input* (it stays on the device through the re-run, so the reference costs no
memory), or, where the argument lives in the storage of an output of an earlier op of the
same chain, a :class:`Made` placeholder (that op's output slot and the argument's view of
it); holding those would keep alive exactly the bytes the plan drops. Outputs are told
apart by their storage's identity (``profiler.storage_id``); a weak reference to each
chain output's storage keeps its identity from being reused within the step.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_map_only

from teraio.core.plan import Recompute
from teraio.core.profiler import fresh_outputs, iter_tensors, storage_key
from teraio.core.recompute import out_variant
from teraio.core.trace import parse_intermediate


@dataclasses.dataclass(frozen=True)
class Made:
    """An argument that is (a view of) output ``slot`` of chain op ``op``: the re-run takes
    it from that op's re-run output with this geometry (sizes, strides and storage offset,
    in elements of ``dtype``)."""

    op: int
    slot: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    def view(self, made: dict[tuple[int, int], torch.Tensor]) -> torch.Tensor:
        """This argument, on the storage of ``made[(op, slot)]`` (a dtype view, such as
        ``view_as_complex``, included)."""
        base = made[(self.op, self.slot)]
        return torch.empty(0, dtype=self.dtype, device=base.device).set_(
            base.untyped_storage(), self.offset, self.size, self.stride)


class Reruns:
    """The records of one plan's recompute chains within a step, and their re-runs.

    Args:
        recomputes: the plan's recomputes (``MigrationPlan.recomputes``); index i of this
            list names recompute i below.

    Per step: :meth:`start_step`, then :meth:`record` after every op of ``ops`` runs, and
    :meth:`replay` of recompute i once its chain has run (at its ``recompute_before`` or
    at an unplanned use).
    """

    def __init__(self, recomputes: list[Recompute]):
        self.recomputes = recomputes
        self.by_op: dict[int, list[int]] = {}
        for i, r in enumerate(recomputes):
            for k in r.ops:
                self.by_op.setdefault(k, []).append(i)
        self.ops = frozenset(self.by_op)
        # in_place[i]: recompute i's last op re-runs through this out= overload straight
        # into the tensor (False: into fresh memory, then copied; None: not recorded yet);
        # the target's geometry, as recorded
        self.in_place = [None] * len(recomputes)
        self._geometry: dict[int, tuple] = {}
        self._records: dict[tuple[int, int], tuple] = {}
        self._outputs: dict[int, tuple[int, int]] = {}
        self._refs: list[StorageWeakRef] = []

    def start_step(self) -> None:
        """Forget the records of the previous step (a step that failed may leave some)."""
        self._records.clear()
        self._outputs.clear()
        self._refs.clear()
        self._geometry.clear()

    def record(self, k: int, func, args: tuple, kwargs: dict | None, out) -> None:
        """Keep the call of chain op ``k`` (just run with ``args``, ``kwargs``, giving ``out``)
        for each recompute whose chain includes it (module docstring)."""
        for i in self.by_op[k]:
            chain = self.recomputes[i].ops

            def keep(x: torch.Tensor):
                where = self._outputs.get(storage_key(x))
                if where is None or where[0] not in chain:
                    return x
                return Made(where[0], where[1], tuple(x.size()), tuple(x.stride()), x.storage_offset(), x.dtype)

            self._records[(i, k)] = (func, *tree_map_only(torch.Tensor, keep, (tuple(args), dict(kwargs or {}))))
        fresh = fresh_outputs(out, {storage_key(x) for x in iter_tensors(args, kwargs)})
        for j, y in enumerate(fresh):
            s = y.untyped_storage()
            self._outputs[storage_key(y)] = (k, j)
            self._refs.append(StorageWeakRef(s))
        for i in self.by_op[k]:
            op, slot = parse_intermediate(self.recomputes[i].name)
            if op == k and slot < len(fresh):
                y = fresh[slot]
                self._geometry[i] = (tuple(y.size()), tuple(y.stride()), y.storage_offset(), y.dtype)
                if len(fresh) == 1 and self.in_place[i] is None:
                    self.in_place[i] = out_variant(str(func)) or False

    def inputs(self, i: int) -> list[torch.Tensor]:
        """The resident tensors recompute i's recorded calls read (made resident before
        :meth:`replay`)."""
        out = []
        for k in self.recomputes[i].ops:
            _, args, kwargs = self._record(i, k)
            out += [x for x in iter_tensors(args, kwargs)]
        return out

    def replay(self, i: int, run: Callable[[Callable], object],
               into: Callable[[], torch.UntypedStorage]) -> torch.Tensor | None:
        """Re-run recompute i's chain; forgets its records. Intermediates of the chain are
        released after their last read within it. ``run(call)`` runs each op's ``call()``
        (the engine's out-of-memory retries). Where the last op has an ``out=`` overload
        (``recompute.out_variant``) it writes straight into ``into()``, the dropped tensor's
        storage allocated again, and None is returned; else the fresh tensor of the target
        (same bytes as the dropped one's), for the caller to copy.

        Raises:
            RuntimeError: a chain op was not recorded in this step (its forward did not run).
        """
        r = self.recomputes[i]
        target = parse_intermediate(r.name)
        last_read: dict[tuple[int, int], int] = {}
        for k in r.ops:
            for m in _placeholders(self._record(i, k)):
                last_read[(m.op, m.slot)] = k
        made: dict[tuple[int, int], torch.Tensor] = {}
        for k in r.ops:
            func, args, kwargs = self._records.pop((i, k))
            args, kwargs = tree_map_only(Made, lambda m: m.view(made), (args, kwargs))
            if k == target[0] and self.in_place[i]:
                size, stride, offset, dtype = self._geometry[i]
                storage = into()
                dest = torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)
                run(lambda: self.in_place[i](*args, **kwargs, out=dest))
                return None
            out = run(lambda: func(*args, **kwargs))
            for j, y in enumerate(fresh_outputs(out, {storage_key(x) for x in iter_tensors(args, kwargs)})):
                made[(k, j)] = y
            del out, args, kwargs
            for key in [key for key, last in last_read.items() if last == k and key != target]:
                made.pop(key, None)
        if target not in made:
            raise RuntimeError(f"re-run of {r.name!r}: its producer op {target[0]} made no output {target[1]}")
        return made[target]

    def _record(self, i: int, k: int) -> tuple:
        rec = self._records.get((i, k))
        if rec is None:
            raise RuntimeError(f"re-run of {self.recomputes[i].name!r}: op {k} of its chain was not "
                               "recorded in this step")
        return rec


def _placeholders(record: tuple) -> list[Made]:
    _, args, kwargs = record
    found: list[Made] = []
    tree_map_only(Made, found.append, (args, kwargs))
    return found
