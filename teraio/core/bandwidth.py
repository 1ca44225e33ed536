"""Migration bandwidth per tier and direction: the numbers the planner (``teraio.core.planner``)
schedules with and the performance model (``teraio.perf.simulator``) replays with.

A tier has two channels, its offload direction (GPU -> tier) and its prefetch direction
(tier -> GPU): ``ssd_write`` / ``ssd_read`` for the SSDs, ``host_d2h`` / ``host_h2d`` for
page-locked host memory (paper §3.2).
"""
from __future__ import annotations

import dataclasses

import numpy as np

CHANNELS: tuple[str, ...] = ("ssd_write", "ssd_read", "host_d2h", "host_h2d")
# (offload channel, prefetch channel) of each tier.
TIER_CHANNELS: dict[str, tuple[str, str]] = {"ssd": ("ssd_write", "ssd_read"),
                                             "host": ("host_d2h", "host_h2d")}
_GB = 1e9


@dataclasses.dataclass(frozen=True)
class TierBandwidth:
    """Migration bandwidth per GPU, GB/s (1e9 bytes/s), per tier and direction.

    ``ssd_write_gbps`` / ``ssd_read_gbps`` are the aggregate over the GPU's drives
    (GPU->SSD offload, SSD->GPU prefetch); ``host_d2h_gbps`` / ``host_h2d_gbps`` the
    GPU<->pinned host memory copies.

    Raises:
        ValueError: a bandwidth that is not a positive finite number.
    """

    ssd_write_gbps: float
    ssd_read_gbps: float
    host_d2h_gbps: float
    host_h2d_gbps: float

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not (isinstance(v, (int, float)) and np.isfinite(v) and v > 0):
                raise ValueError(f"TierBandwidth.{f.name}={v!r}; must be a positive number of GB/s")

    @classmethod
    def uniform(cls, gbps: float) -> "TierBandwidth":
        """Every tier and direction at ``gbps`` GB/s (the roofline's single bandwidth)."""
        return cls(gbps, gbps, gbps, gbps)

    def bytes_per_second(self, channel: str) -> float:
        """Bytes/s of ``channel``, one of :data:`CHANNELS`."""
        return getattr(self, f"{channel}_gbps") * _GB
