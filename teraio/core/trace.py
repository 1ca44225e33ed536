"""The profiled tensor-lifetime trace of one training iteration (paper §3.1).

A :class:`Trace` is what the profiler emits and what the planner and simulator consume.
It is plain data (numpy arrays and small records) so that it can be saved, reloaded and
planned on a machine without a GPU.

Conventions
-----------
* Time is the op index ``k`` in ``0 .. n_ops-1`` of one training iteration (forward,
  backward, optimizer step, zero_grad), and ``op_seconds[k]`` is op k's measured duration
  in **seconds**. Op k starts at ``op_start_seconds()[k]``.
* A tensor record is one *storage* (all views of it share the record), of ``nbytes`` bytes.
* ``uses`` are the sorted op indices that read or write the storage. For an intermediate
  tensor (``persistent=False``) the first use is the op that allocated it and the last use
  is its last reader; it occupies memory from ``uses[0]`` to ``uses[-1]`` inclusive.
  A persistent tensor (parameter, optimizer state) occupies memory for the whole iteration
  and its inactive period may wrap from its last use to its first use in the next
  iteration.
* Tensor ids (``tid``) are stable across iterations: persistent tensors are named by
  ``name`` (``"param:<fqn>"``, ``"optim:<fqn>:<state key>"``); intermediates by
  ``"op<k>:out<j>"``, the j-th output of op k, which the engine matches in later
  iterations.
"""
from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path
from typing import Literal

import numpy as np

from teraio.files import write_atomic

TensorKind = Literal["param", "grad", "optim", "activation", "temp", "input"]
TENSOR_KINDS: tuple[str, ...] = ("param", "grad", "optim", "activation", "temp", "input")


def parse_intermediate(name: str) -> tuple[int, int]:
    """``"op<k>:out<j>"`` (the name the profiler gives output slot j of op k) -> (k, j).

    Raises:
        ValueError: ``name`` is not such a name.
    """
    op, _, out = name.partition(":")
    if not (op.startswith("op") and out.startswith("out") and op[2:].isdigit() and out[3:].isdigit()):
        raise ValueError(f"{name!r} is not an intermediate tensor name (op<k>:out<j>)")
    return int(op[2:]), int(out[3:])


def param_of(name: str) -> str | None:
    """The parameter a persistent tensor belongs to (``"param:<fqn>"`` for ``"param:<fqn>"``
    and ``"optim:<fqn>:<state key>"``); None for any other name."""
    if name.startswith("param:"):
        return name
    if name.startswith("optim:"):
        return "param:" + name[len("optim:"):].rpartition(":")[0]
    return None


@dataclasses.dataclass
class TensorRecord:
    """One storage seen during the profiled iteration.

    Attributes:
        tid: dense index into ``Trace.tensors``.
        name: stable name (see module docstring).
        nbytes: storage size in bytes.
        kind: one of ``TENSOR_KINDS``.
        persistent: True if the storage lives across iterations (params, optimizer state).
        uses: sorted op indices touching the storage (non-empty).
    """

    tid: int
    name: str
    nbytes: int
    kind: str
    persistent: bool
    uses: list[int]

    def __post_init__(self) -> None:
        if self.kind not in TENSOR_KINDS:
            raise ValueError(f"tensor {self.name!r}: kind {self.kind!r} not in {TENSOR_KINDS}")
        if not self.uses:
            raise ValueError(f"tensor {self.name!r}: uses must be non-empty")
        if self.nbytes < 0:
            raise ValueError(f"tensor {self.name!r}: nbytes {self.nbytes} < 0")


@dataclasses.dataclass
class Trace:
    """One iteration's ops and tensor lifetimes.

    Attributes:
        op_names: ``n_ops`` aten op names (e.g. ``"aten.mm.default"``).
        op_seconds: float64 array ``[n_ops]``, op durations in seconds.
        tensors: records, ``tensors[i].tid == i``.
        meta: free-form facts (model, device, batch, seq_len, profiled iterations, ...).
        op_allocated_bytes: optional int64 ``[n_ops]``, the device allocator's peak of
            allocated bytes during each op (CUDA profiles only; None elsewhere). It sees
            what tensor lifetimes cannot: allocator rounding, workspaces, and temporaries
            Python keeps alive past their last use.
    """

    op_names: list[str]
    op_seconds: np.ndarray
    tensors: list[TensorRecord]
    meta: dict = dataclasses.field(default_factory=dict)
    op_allocated_bytes: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.op_seconds = np.asarray(self.op_seconds, dtype=np.float64)
        if self.op_seconds.shape != (len(self.op_names),):
            raise ValueError(
                f"op_seconds has shape {self.op_seconds.shape}, expected ({len(self.op_names)},)")
        if self.op_allocated_bytes is not None:
            self.op_allocated_bytes = np.asarray(self.op_allocated_bytes, dtype=np.int64)
            if self.op_allocated_bytes.shape != self.op_seconds.shape:
                raise ValueError(f"op_allocated_bytes has shape {self.op_allocated_bytes.shape}, "
                                 f"expected ({self.n_ops},)")
        for i, t in enumerate(self.tensors):
            if t.tid != i:
                raise ValueError(f"tensors[{i}] has tid {t.tid}; tids must be dense 0..n-1")
            if t.uses[0] < 0 or t.uses[-1] >= self.n_ops:
                raise ValueError(f"tensor {t.name!r}: uses {t.uses[0]}..{t.uses[-1]} outside 0..{self.n_ops - 1}")

    @property
    def n_ops(self) -> int:
        return len(self.op_names)

    def op_start_seconds(self) -> np.ndarray:
        """float64 ``[n_ops + 1]``: start time of each op (seconds), last entry = iteration time."""
        return np.concatenate([[0.0], np.cumsum(self.op_seconds)])

    def live_bytes(self) -> np.ndarray:
        """int64 ``[n_ops]``: bytes resident during each op with no offloading.

        Persistent tensors count everywhere; an intermediate counts from its first to its
        last use, inclusive.
        """
        delta = np.zeros(self.n_ops + 1, dtype=np.int64)
        for t in self.tensors:
            if t.persistent:
                delta[0] += t.nbytes
            else:
                delta[t.uses[0]] += t.nbytes
                delta[t.uses[-1] + 1] -= t.nbytes
        return np.cumsum(delta[:-1])

    def live_bytes_by_kind(self) -> dict[str, np.ndarray]:
        """``{kind: int64 [n_ops]}``: :meth:`live_bytes` split by tensor kind (``TENSOR_KINDS``;
        a kind with no tensor is all zeros). The arrays add up to :meth:`live_bytes`."""
        delta = {k: np.zeros(self.n_ops + 1, dtype=np.int64) for k in TENSOR_KINDS}
        for t in self.tensors:
            d = delta[t.kind]
            if t.persistent:
                d[0] += t.nbytes
            else:
                d[t.uses[0]] += t.nbytes
                d[t.uses[-1] + 1] -= t.nbytes
        return {k: np.cumsum(d[:-1]) for k, d in delta.items()}

    def required_bytes(self) -> np.ndarray:
        """int64 ``[n_ops]``: device memory each op needs with no offloading (the paper's
        M[k], Algorithm 1): the larger of the tensor-lifetime count and, where profiled,
        the allocator's measured peak. The planner starts from this."""
        live = self.live_bytes()
        return live if self.op_allocated_bytes is None else np.maximum(live, self.op_allocated_bytes)

    def peak_bytes(self) -> int:
        """Peak of :meth:`required_bytes` (bytes): the un-offloaded peak, M's numerator."""
        return int(self.required_bytes().max()) if self.n_ops else 0

    def held_grad_bytes(self, end: int | None = None) -> np.ndarray:
        """int64 ``[n_ops]``: bytes of gradients past their last use that ``param.grad``
        still holds during each op, until ``optimizer.step`` ends (``zero_grad`` follows it,
        ``teraio.workload.step``). The tensor-lifetime count omits them; a CUDA profile's
        ``op_allocated_bytes`` includes them.

        Args:
            end: the first op after ``optimizer.step``; None reads ``meta["optimizer_ops"]``.

        Raises:
            ValueError: ``end`` is None and the trace has no ``meta["optimizer_ops"]``
                (profiles made before ``teraio.core.profiler`` recorded it, and synthesized traces).
        """
        if end is None:
            if len(self.meta.get("optimizer_ops", ())) != 2:
                raise ValueError("trace has no meta['optimizer_ops'] = [first, end) of optimizer.step; "
                                 "profile it again with teraio.core.profiler.profile_step")
            end = int(self.meta["optimizer_ops"][1])
        delta = np.zeros(self.n_ops + 1, dtype=np.int64)
        for t in self.tensors:
            if t.kind == "grad" and t.uses[-1] + 1 < end:
                delta[t.uses[-1] + 1] += t.nbytes
                delta[end] -= t.nbytes
        return np.cumsum(delta[:-1])

    def with_released_grads(self) -> "Trace":
        """This trace as seen by an engine that frees each gradient right after its last use
        (``MigrationEngine(release_grads=True)``): ``op_allocated_bytes`` less
        :meth:`held_grad_bytes`. Tensors, op names and times are shared, not copied; a trace
        without ``op_allocated_bytes`` (CPU profiles) is returned as is.

        Raises:
            ValueError: as :meth:`held_grad_bytes`.
        """
        held = self.held_grad_bytes()  # first, so that every trace without the meta is refused
        if self.op_allocated_bytes is None:
            return self
        return dataclasses.replace(self, op_allocated_bytes=self.op_allocated_bytes - held,
                                   meta={**self.meta, "released_grads": True})

    def update_blocks(self) -> dict[str, tuple[int, int, str | None]]:
        """Per parameter updated in ``optimizer.step``, ``(first, end, grad)``: the ops
        ``[first, end)`` of its update and the name of the gradient it reads. A per-tensor
        optimizer (``teraio.workload.step.make_optimizer``) updates one parameter after the
        other, so each parameter's ops are one run: those touching its parameter, state or
        gradient, and those touching only what such an op made (its temporaries).

        Raises:
            ValueError: no ``meta["optimizer_ops"]``, or a parameter whose ops are not one run
                (an optimizer that updates several at once, e.g. ``foreach``).
        """
        if len(self.meta.get("optimizer_ops", ())) != 2:
            raise ValueError("trace has no meta['optimizer_ops'] = [first, end) of optimizer.step; "
                             "profile it again with teraio.core.profiler.profile_step")
        first, end = (int(x) for x in self.meta["optimizer_ops"])
        by_op: dict[int, list[TensorRecord]] = {}
        for t in self.tensors:
            for u in t.uses:
                if first <= u < end:
                    by_op.setdefault(u, []).append(t)
        owner: dict[int, str] = {}  # tid -> the parameter whose update touched it
        ops: dict[str, list[int]] = {}
        grads: dict[str, str] = {}
        for k in range(first, end):
            touched = by_op.get(k, [])
            params = {param_of(t.name) for t in touched if t.persistent} - {None}
            params |= {owner[t.tid] for t in touched if t.tid in owner}
            if len(params) > 1:
                raise ValueError(f"op {k} ({self.op_names[k]}) of optimizer.step updates {sorted(params)} at once; "
                                 "a host update needs a per-tensor optimizer (foreach=False, fused=False)")
            if not params:
                continue  # the step's own bookkeeping (profiler records, ...)
            (p,) = params
            ops.setdefault(p, []).append(k)
            for t in touched:
                if not t.persistent:
                    owner[t.tid] = p
                    if t.kind == "grad":
                        grads[p] = t.name
        out = {}
        for p, ks in ops.items():
            if ks[-1] - ks[0] + 1 != len(ks):
                raise ValueError(f"the update of {p} is not one run of ops of optimizer.step ({ks[0]}..{ks[-1]}, "
                                 f"{len(ks)} ops); a host update needs a per-tensor optimizer")
            out[p] = (ks[0], ks[-1] + 1, grads.get(p))
        return out

    def with_host_update(self, params: list[str]) -> "Trace":
        """This trace as run with the AdamW update of ``params`` (``"param:<fqn>"`` names) in
        host memory (``teraio.core.host_update``): their ops of ``optimizer.step``
        (:meth:`update_blocks`) removed, their optimizer states gone from the device, their
        gradients' last use their last write in backward, and the ops after the removed ones
        renumbered (intermediates renamed ``op<k>:out<j>`` after their new op), which is the
        op sequence of a step whose device optimizer no longer holds ``params``. The
        allocator's measured peaks (``op_allocated_bytes``) drop the removed states' bytes.

        ``meta["host_update"]`` maps each of ``params`` to ``{"grad", "grad_write",
        "last_use", "first_use", "nbytes"}``: its gradient's name and last write (the op after
        which it goes to host memory), the parameter's last use in the step and first use
        (before which the updated copy must be back; ``teraio.core.host_update`` copies it
        back from the next step's ops), and its bytes. ``meta["optimizer_ops"]`` is renumbered.

        Raises:
            ValueError: a name that :meth:`update_blocks` does not find, or as it.
        """
        blocks = self.update_blocks()
        missing = [p for p in params if p not in blocks or blocks[p][2] is None]
        if missing:
            raise ValueError(f"not updated with a gradient in optimizer.step: {missing[:3]} "
                             f"({len(missing)} of {len(params)}); valid: {sorted(blocks)[:3]} ...")
        keep = np.ones(self.n_ops, dtype=bool)
        for p in params:
            keep[blocks[p][0]:blocks[p][1]] = False
        new = np.cumsum(keep) - 1  # old op -> new op, for kept ops
        dropped = {f"optim:{p[len('param:'):]}:" for p in params}
        tensors, info = [], {}
        for t in self.tensors:
            if t.persistent and any(t.name.startswith(d) for d in dropped):
                continue
            uses = [int(new[u]) for u in t.uses if keep[u]]
            if not uses:
                continue  # a temporary of a removed update
            name = t.name
            if not t.persistent and t.kind != "input":  # inputs are named by record, not by op
                k, j = parse_intermediate(name)
                name = f"op{int(new[k])}:out{j}"
            tensors.append(TensorRecord(len(tensors), name, t.nbytes, t.kind, t.persistent, uses))
        by_name = {t.name: t for t in tensors}
        for p in params:
            grad, param = by_name[blocks[p][2]], by_name[p]
            info[p] = {"grad": grad.name, "grad_write": grad.uses[-1], "last_use": param.uses[-1],
                       "first_use": param.uses[0], "nbytes": param.nbytes}
        state_bytes = sum(t.nbytes for t in self.tensors if t.persistent and any(t.name.startswith(d) for d in dropped))
        first, end = (int(x) for x in self.meta["optimizer_ops"])
        meta = {**self.meta, "optimizer_ops": [int(keep[:first].sum()), int(keep[:end].sum())],
                "host_update": {**self.meta.get("host_update", {}), **info}}
        allocated = None if self.op_allocated_bytes is None else self.op_allocated_bytes[keep] - state_bytes
        return Trace(op_names=[n for n, k in zip(self.op_names, keep) if k], op_seconds=self.op_seconds[keep],
                     tensors=tensors, meta=meta, op_allocated_bytes=allocated)

    def active_bytes(self) -> np.ndarray:
        """int64 ``[n_ops]``: bytes of the tensors op k itself touches (paper Fig. 1 "active")."""
        out = np.zeros(self.n_ops, dtype=np.int64)
        for t in self.tensors:
            np.add.at(out, np.asarray(t.uses), t.nbytes)
        return out

    # ---- persistence -------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": "teraio.trace/1",
            "op_names": self.op_names,
            "op_seconds": self.op_seconds.tolist(),
            "tensors": [dataclasses.asdict(t) for t in self.tensors],
            "meta": self.meta,
            "op_allocated_bytes": None if self.op_allocated_bytes is None else self.op_allocated_bytes.tolist(),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Trace":
        if d.get("format") != "teraio.trace/1":
            raise ValueError(f"not a TeraIO trace: format={d.get('format')!r}, expected 'teraio.trace/1'")
        return cls(op_names=list(d["op_names"]), op_seconds=np.asarray(d["op_seconds"]),
                   tensors=[TensorRecord(**t) for t in d["tensors"]], meta=dict(d.get("meta", {})),
                   op_allocated_bytes=d.get("op_allocated_bytes"))

    def save(self, path: str | Path) -> None:
        """Write JSON atomically, gzip-compressed if ``path`` ends in ``.gz`` (e.g.
        ``trace.json.gz``): a crash never leaves a half-written trace."""
        path = Path(path)
        data = json.dumps(self.to_dict()).encode()
        write_atomic(path, gzip.compress(data) if path.suffix == ".gz" else data)

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        """Read a trace written by :meth:`save` (``.json``, or gzip-compressed ``.json.gz``)."""
        data = Path(path).read_bytes()
        return cls.from_dict(json.loads(gzip.decompress(data) if Path(path).suffix == ".gz" else data))
