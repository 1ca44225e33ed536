"""Migration bandwidth over op index (paper Fig. 10(2) / v1 Fig. 8, claim C11) from the
engine's side files of one run.

``transfers.csv`` (``artifacts["transfers"]``): one row per transfer, columns ``step``,
``tier``, ``direction`` (``offload`` | ``prefetch``), ``nbytes`` (bytes), ``op_issued``,
``op_done``, ``t_issued_s``, ``t_done_s`` (seconds from the start of the step), and in
later logs ``copy_s`` (seconds the copy ran on its CUDA stream; host tier on CUDA only).
``oplog.csv`` (``artifacts["oplog"]``): one row per op, columns ``step``, ``op``,
``op_name``, ``t_start_s``, ``seconds``, ``stall_s``, and in later logs on CUDA
``gpu_start_s`` (where the op began on the compute stream; transfers likewise have their
copy's start there, ``teraio.trainer.logs``).

A transfer's bytes are spread uniformly over [t_issued, t_done]; op k's bin is
[t_start_k, t_start_{k+1}) (the last op's ends at its t_start + seconds), so bins tile the
step and gaps between ops count toward the op before (a last op logged without a duration
gets a zero-length bin). GB = 1e9 bytes.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from teraio.core.engine import union_seconds

TRANSFER_COLUMNS = ("step", "tier", "direction", "nbytes", "op_issued", "op_done",
                    "t_issued_s", "t_done_s")
OPLOG_COLUMNS = ("step", "op", "op_name", "t_start_s", "seconds", "stall_s")
DIRECTIONS = ("offload", "prefetch")


def read_csv_checked(path: Path, columns: tuple[str, ...]) -> pd.DataFrame:
    """Read ``path`` and check it has ``columns``.

    Raises:
        ValueError: a column is missing (names the file, the missing and expected columns).
    """
    df = pd.read_csv(path)
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}; expected {list(columns)}")
    return df


class _Rate:
    """The bytes-in-flight rate of a set of transfers as a function of time: cumulative
    bytes ``B(t)`` (piecewise linear) and rate ``r(t)`` (piecewise constant, bytes/s)."""

    def __init__(self, nbytes, t0, t1):
        nbytes, t0, t1 = (np.asarray(a, float) for a in (nbytes, t0, t1))
        if np.any(t1 < t0):
            bad = int(np.flatnonzero(t1 < t0)[0])
            raise ValueError(f"transfer {bad} ends (t_done_s={t1[bad]}) before it is issued "
                             f"(t_issued_s={t0[bad]})")
        span = t1 - t0
        spread = span > 0
        self.r = np.where(spread, nbytes / np.where(spread, span, 1.0), 0.0)
        self.a_order, self.b_order = np.argsort(t0), np.argsort(t1)
        self.a, self.b = t0[self.a_order], t1[self.b_order]
        ra, rb = self.r[self.a_order], self.r[self.b_order]
        self.cum_ra, self.cum_rat = np.cumsum(ra), np.cumsum(ra * self.a)
        self.cum_rb, self.cum_rbt = np.cumsum(rb), np.cumsum(rb * self.b)
        # zero-length transfers land whole at their issue time
        inst = ~spread
        self.inst_t = np.sort(t0[inst])
        self.inst_cum = np.cumsum(nbytes[inst][np.argsort(t0[inst])])

    @staticmethod
    def _prefix(cum, idx):
        return np.where(idx > 0, cum[np.maximum(idx - 1, 0)] if len(cum) else 0.0, 0.0)

    def cumulative(self, t) -> np.ndarray:
        """B(t): bytes moved by time ``t`` (seconds)."""
        t = np.asarray(t, float)
        ia = np.searchsorted(self.a, t, side="right")
        ib = np.searchsorted(self.b, t, side="right")
        started = t * self._prefix(self.cum_ra, ia) - self._prefix(self.cum_rat, ia)
        finished = t * self._prefix(self.cum_rb, ib) - self._prefix(self.cum_rbt, ib)
        inst = self._prefix(self.inst_cum, np.searchsorted(self.inst_t, t, side="right"))
        return started - finished + inst

    def rate(self, t) -> np.ndarray:
        """r(t): bytes/s in flight at ``t`` (right-continuous)."""
        t = np.asarray(t, float)
        return (self._prefix(self.cum_ra, np.searchsorted(self.a, t, side="right"))
                - self._prefix(self.cum_rb, np.searchsorted(self.b, t, side="right")))


def check_directions(transfers: pd.DataFrame) -> None:
    """Raises:
        ValueError: a transfer's direction is not one of ``DIRECTIONS`` (names them)."""
    bad = sorted(set(transfers["direction"].dropna()) - set(DIRECTIONS))
    if bad:
        raise ValueError(f"transfers: direction(s) {bad} not in {DIRECTIONS}")


def op_bins(oplog: pd.DataFrame, step: int) -> pd.DataFrame:
    """Ops of ``step`` sorted by index with their bin [``t0``, ``t1``) in seconds.

    Raises:
        ValueError: the step has no ops.
    """
    ops = oplog[oplog["step"] == step].sort_values("op")
    if ops.empty:
        raise ValueError(f"oplog has no ops for step {step}; steps present: "
                         f"{sorted(oplog['step'].unique().tolist())}")
    t0 = ops["t_start_s"].to_numpy(float)
    last = float(ops["seconds"].iloc[-1])  # an engine may log NaN for an op it did not time
    t1 = np.append(t0[1:], t0[-1] + (last if np.isfinite(last) else 0.0))
    return pd.DataFrame({"op": ops["op"].to_numpy(), "op_name": ops["op_name"].to_numpy(),
                         "t0": t0, "t1": np.maximum(t1, t0)})


def op_bandwidth(transfers: pd.DataFrame, oplog: pd.DataFrame, step: int) -> pd.DataFrame:
    """Migration bandwidth per op of ``step``: columns ``op``, ``op_name``, ``t0``, ``t1``
    (s), ``offload_gbps``, ``prefetch_gbps`` (GB/s: bytes in the bin ÷ its length; for a
    zero-length bin, the rate at its start).

    Raises:
        ValueError: an unknown direction, or a transfer that ends before it starts.
    """
    check_directions(transfers)
    bins = op_bins(oplog, step)
    tr = transfers[transfers["step"] == step]
    width = (bins["t1"] - bins["t0"]).to_numpy()
    for d in DIRECTIONS:
        x = tr[tr["direction"] == d]
        rate = _Rate(x["nbytes"], x["t_issued_s"], x["t_done_s"])
        moved = rate.cumulative(bins["t1"]) - rate.cumulative(bins["t0"])
        with np.errstate(invalid="ignore", divide="ignore"):
            bw = np.where(width > 0, moved / np.where(width > 0, width, 1.0), rate.rate(bins["t0"]))
        bins[f"{d}_gbps"] = bw / 1e9
    return bins


def share_above(transfers: pd.DataFrame, t_start: float, t_end: float, step: int,
                threshold_gbps: float = 16.0) -> float:
    """Fraction of [``t_start``, ``t_end``) during which offload + prefetch bandwidth exceeds
    ``threshold_gbps`` (paper C11: > 16 GB/s for > 64 % / 82.3 % of the time), exact on the
    piecewise-constant rate."""
    tr = transfers[transfers["step"] == step]
    if t_end <= t_start:
        return float("nan")
    rate = _Rate(tr["nbytes"], tr["t_issued_s"], tr["t_done_s"])
    edges = np.unique(np.clip(np.r_[t_start, t_end, rate.a, rate.b], t_start, t_end))
    r = rate.rate(edges[:-1])
    return float(np.diff(edges)[r > threshold_gbps * 1e9].sum() / (t_end - t_start))


def tier_rates(transfers: pd.DataFrame) -> pd.DataFrame:
    """What each tier achieved over one run's logged steps (an engine logs its measured
    steps), one row per tier, in tier order: ``steps`` (logged steps), ``offload_gb`` and
    ``prefetch_gb`` (GB per step), ``busy_s`` (seconds per step during which at least one of
    the tier's transfers is in flight, either direction), ``offload_gbps`` and
    ``prefetch_gbps`` (a direction's bytes ÷ the time at least one of its transfers is in
    flight, summed over steps; NaN with no such time), ``gbps`` (both directions' bytes ÷
    ``busy_s``), and ``offload_copy_gbps`` and ``prefetch_copy_gbps``: a direction's bytes ÷
    the seconds its copies ran on their CUDA stream (``copy_s``; a direction's copies run one
    after another on one stream, so the sum is the time its stream moved bytes), the link's
    own rate, where the issue-to-done rates above also count the wait for the work queued
    before each copy; NaN without ``copy_s``. GB = 1e9 bytes.

    Raises:
        ValueError: an unknown direction.
    """
    check_directions(transfers)

    def in_flight(steps: pd.DataFrame) -> float:
        """Seconds at least one of the transfers is in flight, within each step, summed."""
        return sum(union_seconds(list(zip(x["t_issued_s"], x["t_done_s"]))) for _, x in steps.groupby("step"))

    n = transfers["step"].nunique()
    rows = []
    for tier, g in transfers.groupby("tier", sort=True):
        busy = {d: in_flight(g[g["direction"] == d]) for d in DIRECTIONS}
        both = in_flight(g)
        moved = {d: float(g.loc[g["direction"] == d, "nbytes"].sum()) for d in DIRECTIONS}
        rate = {d: moved[d] / busy[d] / 1e9 if busy[d] > 0 else np.nan for d in DIRECTIONS}
        rows.append({"tier": tier, "steps": n, "offload_gb": moved["offload"] / n / 1e9,
                     "prefetch_gb": moved["prefetch"] / n / 1e9, "busy_s": both / n,
                     "offload_gbps": rate["offload"], "prefetch_gbps": rate["prefetch"],
                     "gbps": sum(moved.values()) / both / 1e9 if both > 0 else np.nan,
                     **{f"{d}_copy_gbps": copy_rate(g[g["direction"] == d]) for d in DIRECTIONS}})
    return pd.DataFrame(rows, columns=["tier", "steps", "offload_gb", "prefetch_gb", "busy_s",
                                       "offload_gbps", "prefetch_gbps", "gbps", "offload_copy_gbps",
                                       "prefetch_copy_gbps"])


def copy_rate(transfers: pd.DataFrame) -> float:
    """GB/s of ``transfers`` over the seconds their copies ran (``copy_s``), counting those
    with a ``copy_s``; NaN where none has one (or the column is absent)."""
    if "copy_s" not in transfers:
        return np.nan
    timed = transfers[transfers["copy_s"].notna()]
    seconds = float(timed["copy_s"].sum())
    return float(timed["nbytes"].sum()) / seconds / 1e9 if seconds > 0 else np.nan


PLANNED_RATES = {"ssd": ("ssd_write_gbps", "ssd_read_gbps"), "host": ("host_d2h_gbps", "host_h2d_gbps")}


def tier_rates_frame(runs: pd.DataFrame, root: Path) -> pd.DataFrame:
    """:func:`tier_rates` of every ok run with a ``transfers_path`` (``analysis.load``'s
    per-run frame; paths relative to the sweep dir ``root``), with the run's identity
    (``model``, ``config``, ``system``, ``job_dir``) and the rates its plan assumed for the
    tier (``planned_offload_gbps``, ``planned_prefetch_gbps``: the SSD's write and read, the
    host link's D2H and H2D). Empty without such runs."""
    frames = []
    for _, r in runs[~runs["failed"] & runs["transfers_path"].notna()].iterrows():
        rates = tier_rates(read_csv_checked(root / r["transfers_path"], TRANSFER_COLUMNS))
        planned = [PLANNED_RATES.get(t, (None, None)) for t in rates["tier"]]
        frames.append(pd.DataFrame({
            **{key: r[key] for key in ("model", "config", "system", "job_dir")}, **rates.to_dict("series"),
            "planned_offload_gbps": [r[w] if w else np.nan for w, _ in planned],
            "planned_prefetch_gbps": [r[rd] if rd else np.nan for _, rd in planned]}))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def run_bandwidth(root: Path, transfers_path: str, oplog_path: str,
                  step: int | None = None) -> tuple[pd.DataFrame, int, float]:
    """Load one run's side files (paths relative to the sweep dir ``root``) and return
    (:func:`op_bandwidth` frame, the step used, share of the step above 16 GB/s). ``step``
    None takes the last step present in both files (a measured iteration)."""
    transfers = read_csv_checked(root / transfers_path, TRANSFER_COLUMNS)
    oplog = read_csv_checked(root / oplog_path, OPLOG_COLUMNS)
    if step is None:
        common = sorted(set(oplog["step"]) & set(transfers["step"])) or sorted(set(oplog["step"]))
        if not common:
            raise ValueError(f"{root / oplog_path}: no steps")
        step = int(common[-1])
    bins = op_bandwidth(transfers, oplog, step)
    share = share_above(transfers, float(bins["t0"].iloc[0]), float(bins["t1"].iloc[-1]), step)
    return bins, step, share
