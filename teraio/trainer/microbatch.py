"""TeraIO's micro-batch, chosen by simulation (``workload.micro_batch_size: auto``).

The paper trains with the configured micro-batch and notes that offloading lets a larger one
run (its Fig. 7 discussion); ZeRO's baselines pick theirs by measurement
(``teraio.harness.tune``). Here TeraIO picks its own: the candidates are the divisors of the
batch, tried from the largest down; each is profiled (one training step under the pager),
planned at the run's capacity and tiers, and simulated at the tiers' probed rates
(``teraio.core.simulator``); the run trains with the shortest simulated iteration.

Which candidates are profiled (the rule of :class:`MicroBatchSearch`): a smaller
micro-batch trains the same tokens in more, smaller kernels, so its op time (the simulated
*ideal*, no stalls, no recompute) is taken to be no shorter than a larger one's. Once the
best simulated iteration so far is no longer than the ideal of the last candidate profiled,
no smaller candidate can win and the search stops; it also stops after ``max_profiles``
candidates (3: the profiling stays within 3 profiled steps). A candidate whose profiled step
runs out of memory even under the pager (one micro-batch's working set does not fit) is
recorded as ``oom`` and the next smaller one is tried.
"""
from __future__ import annotations

import dataclasses


MAX_PROFILES = 3
"""The most candidate micro-batches :class:`MicroBatchSearch` profiles by default."""


def warmup_steps_needed(micro_batch_size: int | str) -> int:
    """The warm-up steps a TeraIO run takes before it can measure: one to create the optimizer
    state, then one profiled step, or with ``micro_batch_size="auto"`` up to
    :data:`MAX_PROFILES` profiled candidates."""
    return 1 + (MAX_PROFILES if micro_batch_size == "auto" else 1)


def warmup_refusal(warmup_steps: int, micro_batch_size: int | str) -> str | None:
    """Why ``workload.warmup_steps`` is too few for a TeraIO run (:func:`warmup_steps_needed`),
    naming the value and what is valid; None where it is enough."""
    need = warmup_steps_needed(micro_batch_size)
    if warmup_steps >= need:
        return None
    why = (f"up to {MAX_PROFILES} profiled candidate micro-batches" if micro_batch_size == "auto"
           else "one profiled step")
    return (f"workload.warmup_steps={warmup_steps}: TeraIO needs >= {need} (one step to create the "
            f"optimizer state, {why}); give workload.warmup_steps={need} or more")


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` (>= 1), largest first."""
    if n < 1:
        raise ValueError(f"batch_size={n} must be >= 1")
    return [d for d in range(n, 0, -1) if n % d == 0]


@dataclasses.dataclass
class Candidate:
    """One micro-batch the search tried.

    Attributes:
        micro_batch_size: the candidate.
        status: ``"simulated"``, or ``"oom"`` (its profiled step did not fit under the pager).
        ideal_seconds: its profiled op time, s (``SimResult.ideal_seconds``); None unless simulated.
        simulated_seconds: its planned iteration, simulated, s; None unless simulated.
        profile_step: the training step that profiled it.
    """

    micro_batch_size: int
    status: str
    ideal_seconds: float | None = None
    simulated_seconds: float | None = None
    profile_step: int | None = None


class MicroBatchSearch:
    """Which micro-batch to profile next and which one won (module docstring).

    Args:
        batch_size: the global batch; its divisors are the candidates.
        max_profiles: most candidates profiled (``oom`` ones included), >= 1.
    """

    def __init__(self, batch_size: int, max_profiles: int = MAX_PROFILES):
        if max_profiles < 1:
            raise ValueError(f"max_profiles={max_profiles} must be >= 1")
        self.order = divisors(batch_size)
        self.max_profiles = max_profiles
        self.tried: list[Candidate] = []

    def next(self) -> int | None:
        """The next candidate to profile, or None when the search is over."""
        if len(self.tried) >= self.max_profiles or len(self.tried) == len(self.order):
            return None
        done = [c for c in self.tried if c.status == "simulated"]
        if done and self.best().simulated_seconds <= done[-1].ideal_seconds:
            return None
        return self.order[len(self.tried)]

    def add(self, candidate: Candidate) -> None:
        """Record the outcome of profiling the candidate :meth:`next` named.

        Raises:
            ValueError: it is not that candidate, or a simulated one lacks its seconds.
        """
        expected = self.order[len(self.tried)] if len(self.tried) < len(self.order) else None
        if candidate.micro_batch_size != expected:
            raise ValueError(f"micro_batch_size={candidate.micro_batch_size}; the search expects {expected}")
        if candidate.status == "simulated" and (candidate.ideal_seconds is None or candidate.simulated_seconds is None):
            raise ValueError(f"candidate {candidate.micro_batch_size}: simulated without its seconds")
        self.tried.append(candidate)

    def best(self) -> Candidate:
        """The simulated candidate with the shortest simulated iteration (the larger one on a tie).

        Raises:
            RuntimeError: no candidate fit under the pager.
        """
        done = [c for c in self.tried if c.status == "simulated"]
        if not done:
            raise RuntimeError("workload.micro_batch_size=auto: no candidate micro-batch fit under the pager "
                               f"(tried {[c.micro_batch_size for c in self.tried]})")
        return min(done, key=lambda c: (c.simulated_seconds, -c.micro_batch_size))

    def record(self) -> dict:
        """What the row keeps: every candidate tried and the choice."""
        return {"candidates": [dataclasses.asdict(c) for c in self.tried],
                "chosen": self.best().micro_batch_size}
