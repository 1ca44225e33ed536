"""The migration plan: what the planner emits and the engine executes (paper §3.2, Fig. 4).

One :class:`Migration` covers one inactive period of one tensor. Its four op indices,
in cyclic order along the iteration starting from ``offload_after``, are:

``offload_after`` (a)
    the tensor's last use before the inactive period; the offload is launched right
    after op a (the paper's offload *start*).
``free_before`` (k_free)
    the offload must be complete before op k_free; the engine waits for the write if
    needed (a stall) and frees the HBM storage. Memory is saved from op k_free on
    (the paper's offload *deadline*, t_offloaded).
``prefetch_before`` (k_pf)
    the engine allocates the storage and launches the read before op k_pf; memory is
    used again from op k_pf on (the paper's prefetch start, t_prefetch).
``needed_by`` (b)
    the tensor's next use; the engine waits for the read before op b (the prefetch
    deadline).

Memory is saved for ops in the cyclic interval ``[k_free, k_pf)``. A period of a
persistent tensor may wrap across the iteration boundary (``a > b``); then the
migration may also be *offloaded at iteration start* (op 0 inside ``[k_free, k_pf)``),
and the engine offloads it before the first step it runs.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from teraio.files import write_atomic

TIERS: tuple[str, ...] = ("ssd", "host")


def cyclic_between(k: int, lo: int, hi: int, n: int) -> bool:
    """True if op k lies in the cyclic half-open interval ``[lo, hi)`` of ``n`` ops."""
    return (k - lo) % n < (hi - lo) % n if lo != hi else False


@dataclasses.dataclass
class Migration:
    """One planned offload + prefetch of one tensor over one inactive period.

    Attributes:
        tid: the tensor's ``Trace`` id; ``name`` its stable name.
        nbytes: bytes moved each way.
        tier: ``"ssd"`` or ``"host"``.
        offload_after, free_before, prefetch_before, needed_by: op indices, see module doc.
        slot: the name of the tensor whose tier slot holds the bytes: ``name`` itself, or
            another tensor's whose periods never overlap this tensor's
            (``teraio.core.slots``); empty in plans made before slots were shared (each
            tensor then has its own).
        offset: the tensor's byte offset in the host region of a plan made with
            ``host_arena`` (its ``slot`` is then its own name); -1 otherwise.
        launch_after: the op after which the offload's copy is launched, in
            ``[offload_after, free_before)`` of the same iteration, where the copies are put in
            deadline order (``teraio.perf.retime``); -1: ``offload_after``.
        launch_before: the op before which the prefetch's copy is launched (and its storage
            allocated), in ``[prefetch_before, needed_by)`` of the same iteration; -1:
            ``prefetch_before``. Launching later never holds more device memory than the
            plan accounts: the tensor's bytes are freed at ``free_before`` and allocated
            again at the launch.
    """

    tid: int
    name: str
    nbytes: int
    tier: str
    offload_after: int
    free_before: int
    prefetch_before: int
    needed_by: int
    slot: str = ""
    offset: int = -1
    launch_after: int = -1
    launch_before: int = -1

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"migration of {self.name!r}: tier {self.tier!r} not in {TIERS}")

    @property
    def offload_launch(self) -> int:
        """The op after which the offload's copy is launched."""
        return self.offload_after if self.launch_after < 0 else self.launch_after

    @property
    def prefetch_launch(self) -> int:
        """The op before which the prefetch's storage is allocated and its copy launched."""
        return self.prefetch_before if self.launch_before < 0 else self.launch_before

    @property
    def wraps(self) -> bool:
        """True if the inactive period crosses the iteration boundary."""
        return self.needed_by <= self.offload_after

    def saves_at(self, k: int, n_ops: int) -> bool:
        """True if the tensor is off HBM during op k."""
        return cyclic_between(k, self.free_before, self.prefetch_before, n_ops)

    def offloaded_at_iteration_start(self, n_ops: int) -> bool:
        return self.wraps and self.saves_at(0, n_ops)


@dataclasses.dataclass
class Recompute:
    """One planned drop-and-recompute of one tensor over one inactive period: the third option
    beside the SSD and host tiers (``teraio.core.planner``, ``recompute=``).

    The tensor is dropped after its use ``drop_after`` (a) and made again before op
    ``recompute_before`` (r, at most its next use ``needed_by``, b) by re-running ``ops``,
    the op indices of the trace (ascending) that produced it and the tensors in between that
    are dead by op b, from ``inputs``, the tids of the tensors those ops read that are
    resident from op r through op b. Memory is saved for ops in ``[a + 1, r)``; the re-run
    costs ``seconds`` (the ops' profiled times, on the compute stream before op r) and,
    while it runs, up to ``extra_bytes`` beyond the tensor itself.

    Attributes:
        tid, name, nbytes: the tensor's ``Trace`` id, stable name and bytes.
        drop_after, recompute_before, needed_by: op indices, see above.
        ops: the producing ops, ascending.
        inputs: tids of the tensors the ops read that stay resident through op b.
        seconds: the ops' profiled seconds in all.
        extra_bytes: the most bytes the re-run holds beyond the tensor (its intermediates).
    """

    tid: int
    name: str
    nbytes: int
    drop_after: int
    recompute_before: int
    needed_by: int
    ops: list[int]
    inputs: list[int]
    seconds: float
    extra_bytes: int = 0

    def saves_at(self, k: int, n_ops: int) -> bool:
        """True if the tensor is off HBM during op k."""
        return cyclic_between(k, self.drop_after + 1, self.recompute_before, n_ops)


@dataclasses.dataclass
class MigrationPlan:
    """A per-GPU migration plan (paper Fig. 4 "Per-GPU Tensor Migration Plans").

    Attributes:
        n_ops: ops per iteration of the trace the plan was made for.
        capacity_bytes: the GPU memory capacity planned for, bytes.
        baseline_peak_bytes: peak live bytes with no offloading.
        predicted_peak_bytes: peak live bytes with the plan applied.
        migrations: the chosen migrations, in the order the planner chose them.
        meta: planner settings (benefit variant, bandwidths in GB/s, host cap in bytes,
            compile seconds, ...).
        recomputes: the tensors dropped and recomputed instead of moved (:class:`Recompute`),
            in the order chosen; empty unless planned with ``recompute``.
    """

    n_ops: int
    capacity_bytes: int
    baseline_peak_bytes: int
    predicted_peak_bytes: int
    migrations: list[Migration]
    meta: dict = dataclasses.field(default_factory=dict)
    recomputes: list[Recompute] = dataclasses.field(default_factory=list)

    @property
    def shortfall_bytes(self) -> int:
        """How far the predicted peak stays above capacity (0 if the plan is feasible)."""
        return max(0, self.predicted_peak_bytes - self.capacity_bytes)

    @property
    def feasible(self) -> bool:
        return self.shortfall_bytes == 0

    def shared_slots(self, tier: str) -> dict[str, str]:
        """Tensor name -> the name of the slot's owner, for ``tier``'s tensors that use
        another tensor's slot (the argument ``shares`` of the tiers in
        ``teraio.core.tiers``)."""
        return {m.name: m.slot for m in self.migrations
                if m.tier == tier and m.slot and m.slot != m.name}

    def host_offsets(self) -> dict[str, int] | None:
        """Tensor name -> its byte offset in the host region (the argument ``offsets`` of
        ``teraio.core.tiers.host.HostTier``); None for a plan that places the host in slots."""
        host = [m for m in self.migrations if m.tier == "host"]
        if not any(m.offset >= 0 for m in host):
            return None
        return {m.name: m.offset for m in host}

    def tier_bytes_held(self, tier: str) -> np.ndarray:
        """int64 ``[n_ops]``: bytes that ``tier`` holds for the plan during each op. A
        migration holds its bytes over its period ``[offload_after, needed_by)`` (cyclic;
        the slot convention of ``teraio.core.slots``): from the write's launch until the read
        back is needed. The maximum is the least a tier of this plan must hold at once,
        however its slots are packed.

        Raises:
            ValueError: ``tier`` is not one of ``TIERS``.
        """
        if tier not in TIERS:
            raise ValueError(f"tier={tier!r}; must be one of {TIERS}")
        delta = np.zeros(self.n_ops + 1, dtype=np.int64)
        for m in self.migrations:
            if m.tier != tier:
                continue
            a, b = m.offload_after, m.needed_by
            delta[a] += m.nbytes
            delta[b] -= m.nbytes
            if a >= b:  # wraps across the iteration boundary
                delta[0] += m.nbytes
                delta[self.n_ops] -= m.nbytes
        return np.cumsum(delta[:-1])

    def recomputed_bytes(self) -> int:
        """Bytes the plan drops and recomputes per iteration (each made once more)."""
        return sum(r.nbytes for r in self.recomputes)

    def bytes_per_tier(self) -> dict[str, int]:
        out = {t: 0 for t in TIERS}
        for m in self.migrations:
            out[m.tier] += m.nbytes
        return out

    def to_dict(self) -> dict:
        """The plan as JSON-ready data; a migration's launch ops only where they are set
        (plans made before they existed read the same)."""
        d = {"format": "teraio.plan/1", **dataclasses.asdict(self)}
        for m in d["migrations"]:
            for key in ("launch_after", "launch_before"):
                if m[key] < 0:
                    del m[key]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "MigrationPlan":
        if d.get("format") != "teraio.plan/1":
            raise ValueError(f"not a TeraIO plan: format={d.get('format')!r}, expected 'teraio.plan/1'")
        d = {k: v for k, v in d.items() if k != "format"}
        d["migrations"] = [Migration(**m) for m in d["migrations"]]
        d["recomputes"] = [Recompute(**r) for r in d.get("recomputes", [])]
        return cls(**d)

    def save(self, path: str | Path) -> None:
        """Write JSON atomically (a crash never leaves a half-written plan)."""
        write_atomic(path, json.dumps(self.to_dict()).encode())

    @classmethod
    def load(cls, path: str | Path) -> "MigrationPlan":
        return cls.from_dict(json.loads(Path(path).read_text()))
