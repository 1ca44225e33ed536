"""Other micro-batches of a TeraIO point, planned and simulated on CPU: each profiled trace
(``--trace``, e.g. the same model and batch profiled at another micro-batch by
``benchmarks.engine_tax``) planned by the current planner at one committed run's settings
(``JOB_DIR``'s plan: capacity, host cap, rates, drive model, SSD room;
``teraio.perf.replay.plan_as_committed``) with ``recompute`` off, on and ``"auto"``, as a run
with ``release_grads`` plans it, and each plan simulated with the channels in issue order
(FIFO, the engine's order) and earliest deadline first (EDF, preempting). What
``workload.micro_batch_size: auto`` (``teraio.trainer.microbatch``) would weigh, from traces
already committed, without a GPU.

    python -m benchmarks.microbatch_plans JOB_DIR --trace LABEL=TRACE [LABEL=TRACE ...] --out FILE.json

Per trace: its label, file, profiled op sum ``ideal_s``, and per recompute setting the
simulated FIFO and EDF iteration and stall seconds, bytes moved per tier and iteration, the
recomputes and their bytes. The job's own trace is included as label ``job``. ``--out`` is
replaced atomically.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks import command, refusing
from teraio.core.trace import Trace
from teraio.files import write_atomic
from teraio.perf import jobdir
from teraio.perf.replay import plan_as_committed, plan_tiers
from teraio.perf.simulator import simulate

RECOMPUTE = {"off": False, "on": True, "auto": "auto"}


def plans(trace: Trace, job: Path) -> dict:
    """``trace`` planned at ``job``'s committed settings with each recompute setting, each plan
    simulated FIFO and EDF.

    Raises:
        ValueError: ``job`` lacks its plan (``teraio.perf.jobdir``).
    """
    committed = jobdir.plan(job)
    tiers, shared = plan_tiers(committed), committed.meta["shared_ssd"]
    out = {"ideal_s": float(trace.op_seconds.sum())}
    for name, recompute in RECOMPUTE.items():
        plan = plan_as_committed(trace, committed, recompute=recompute)
        fifo, edf = (simulate(trace, plan, tiers, policy=p, shared_ssd=shared, stream_frees=plan.meta["stream_frees"])
                     for p in ("fifo", "edf"))
        out[name] = {"fifo_s": fifo.iteration_seconds, "fifo_stall_s": fifo.stall_seconds,
                     "edf_s": edf.iteration_seconds, "edf_stall_s": edf.stall_seconds,
                     "bytes_per_tier": plan.bytes_per_tier(), "recomputes": len(plan.recomputes),
                     "recomputed_bytes": plan.recomputed_bytes(), "shortfall_bytes": plan.shortfall_bytes}
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("job", type=Path, help="a TeraIO job directory whose plan gives the settings")
    ap.add_argument("--trace", nargs="+", default=[], metavar="LABEL=TRACE",
                    help="profiled traces to plan at the job's settings, each with a label")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    bad = [t for t in args.trace if "=" not in t or not t.split("=", 1)[0]]
    if bad:
        ap.error(f"--trace {bad[0]!r}: give LABEL=TRACE, e.g. mb4=benchmarks/results/engine_tax_h100/"
                 "engine_tax.trace_unpaged.json.gz")
    rows = []
    with refusing("benchmarks.microbatch_plans"):
        traces = [("job", str(args.job), jobdir.trace(args.job, released_grads=True))]
        traces += [(label, path, jobdir.read_trace(path).with_released_grads())
                   for label, path in (t.split("=", 1) for t in args.trace)]
        for label, path, trace in traces:
            rows.append({"label": label, "trace": path, **plans(trace, args.job)})
    write_atomic(args.out, json.dumps({"command": command("benchmarks.microbatch_plans", argv), "traces": rows},
                                      indent=1).encode())
    for r in rows:
        print(f"{r['label']}: ideal {r['ideal_s']:.3f} s; " + "; ".join(
            f"recompute {k}: FIFO {r[k]['fifo_s']:.3f} s, EDF {r[k]['edf_s']:.3f} s" for k in RECOMPUTE))


if __name__ == "__main__":
    main()
