"""How much of a CUDA trace's allocator-measured floor is gradients held past their last use.

The trace counts a gradient as live from its first to its last use (its parameter's
AdamW update). ``param.grad`` keeps it allocated until ``zero_grad`` after the whole
optimizer step (``teraio/workload/step.py``). The allocator's per-op peak
(``Trace.op_allocated_bytes``, CUDA profiles only) sees those bytes; no migration of the
plan can lower them. This prints, at ops through the optimizer step, the allocator's
excess over the tensor-lifetime count and the bytes of gradients already past their last
use, both in bytes.

    python -m benchmarks.held_grads TRACE.json [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from teraio.core.trace import Trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    trace = Trace.load(args.trace)
    if trace.op_allocated_bytes is None:
        raise SystemExit(f"{args.trace}: no op_allocated_bytes (not a CUDA profile)")
    excess = trace.op_allocated_bytes - trace.live_bytes()
    # Traces profiled before meta["optimizer_ops"] existed (the committed slice's) do not
    # say where optimizer.step ends: count to the trace's end, which overcounts after the
    # step; the ops printed lie inside it.
    held = trace.held_grad_bytes(end=trace.meta.get("optimizer_ops", [0, trace.n_ops])[1])
    last_uses = sorted(t.uses[-1] for t in trace.tensors if t.kind == "grad")
    first, last = last_uses[0], last_uses[-1]
    ops = sorted({first, (first + last) // 2, last, min(last + 1, trace.n_ops - 1)})
    out = {"trace": str(args.trace), "n_ops": trace.n_ops,
           "grad_bytes": int(sum(t.nbytes for t in trace.tensors if t.kind == "grad")),
           "ops": [{"op": k, "name": trace.op_names[k], "allocator_excess_bytes": int(excess[k]),
                    "held_grad_bytes": int(held[k])} for k in ops]}
    print(json.dumps(out, indent=1))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
