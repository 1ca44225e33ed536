"""The op log and transfer log of a TeraIO run (``oplog.csv``, ``transfers.csv`` in its job
dir, or its stage's directory): per op of each measured step its start time and stall, one row
per transfer. On CUDA the GPU's own timeline beside the host's: ``gpu_start_s``, seconds
from the step's start on the compute stream to where an op began there (after its waits),
or where a host-tier copy began on its stream, ``gpu_end_s`` to where the op's kernels were
queued up to, and ``copy_s``, seconds that copy ran; empty elsewhere (``teraio.core.engine``).
"""
from __future__ import annotations

import csv
from pathlib import Path


class EngineLogs:
    """``oplog.csv`` and ``transfers.csv`` of the steps from ``first_step`` on, over every
    engine of the run (several where it planned again), written as the steps go: each
    :meth:`write` takes the engines' records (``MigrationEngine.take_logs``), so that a long
    run's memory stays flat."""

    TRANSFER_COLUMNS = ["step", "tensor", "tier", "direction", "nbytes", "op_issued", "op_done",
                        "t_issued_s", "t_done_s", "copy_s", "gpu_start_s"]

    def __init__(self, job_dir: Path, first_step: int):
        self.paths = [job_dir / "oplog.csv", job_dir / "transfers.csv"]
        self.first_step = first_step
        self._files = [open(p, "w", newline="") for p in self.paths]
        self._ops = csv.writer(self._files[0])
        self._ops.writerow(["step", "op", "op_name", "t_start_s", "seconds", "stall_s", "gpu_start_s", "gpu_end_s"])
        self._transfers = csv.DictWriter(self._files[1], fieldnames=self.TRANSFER_COLUMNS)
        self._transfers.writeheader()

    def write(self, runs: list) -> None:
        """Write and forget the records of each ``(engine, trace)`` of ``runs``."""
        for engine, trace in runs:
            oplog, transfers = engine.take_logs()
            for row in oplog:
                if row["step"] < self.first_step:
                    continue
                t = row["t_start_s"]
                dur = list(t[1:] - t[:-1]) + [float("nan")]
                gpu, end = row.get("gpu_start_s"), row.get("gpu_end_s")
                for k in range(trace.n_ops):
                    self._ops.writerow([row["step"], k, trace.op_names[k], f"{t[k]:.9f}", f"{dur[k]:.9f}",
                                        f"{row['stall_s'][k]:.9f}", "" if gpu is None else f"{gpu[k]:.9f}",
                                        "" if end is None else f"{end[k]:.9f}"])
            self._transfers.writerows(r for r in transfers if r["step"] >= self.first_step)

    def close(self) -> None:
        for f in self._files:
            f.close()

    def discard(self) -> None:
        """Close and delete the files (a failed run)."""
        self.close()
        for p in self.paths:
            p.unlink(missing_ok=True)
