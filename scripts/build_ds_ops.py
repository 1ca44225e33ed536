"""Build the DeepSpeed JIT ops a ZeRO run loads, once, into the project's
``TORCH_EXTENSIONS_DIR``.

    python scripts/build_ds_ops.py             # every op this machine's ZeRO runs load
    python scripts/build_ds_ops.py cpu_adam    # one op

Ops: ``cpu_adam`` (DeepSpeedCPUAdam), ``async_io`` (ZeRO-Infinity's NVMe swapping; needs
``apt-get install -y libaio-dev``) and, on DeepSpeed's CPU accelerator only,
``deepspeed_shm_comm`` (loaded by its torch.distributed wrapper) and ``pin_memory``.
First builds take minutes each on a small CPU machine; a second call finds them built and
only loads them (seconds).

The directory is ``$TORCH_EXTENSIONS_DIR`` when set, else the default of
:func:`baselines.zero.use_extensions_dir` (``<repo>/.torch_extensions/<py>_<cpu|cuXYZ>``,
git-ignored), the one the ZeRO worker loads from. Stale ``lock`` files are removed
first: torch's JIT loader waits forever on a lock left by an interrupted build (so do
not run this while another build is running).

Exit status: 0 when every requested op loads, 1 otherwise (each error is printed).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baselines.zero import use_extensions_dir  # noqa: E402

BUILDERS = {"cpu_adam": "CPUAdamBuilder", "async_io": "AsyncIOBuilder",
            "deepspeed_shm_comm": "ShareMemCommBuilder", "pin_memory": "PinMemoryBuilder"}
CPU_ONLY = ("deepspeed_shm_comm", "pin_memory")
# A first build's wall time on the CI machine (2 cores; a clean clone's .ci/run; four runs
# in benchmarks/results/ds_op_builds_ci.md): what a newcomer waits through, said before
# the build starts.
FIRST_BUILD = {"cpu_adam": "1-2 min", "async_io": "7-9 min", "deepspeed_shm_comm": "1-1.5 min",
               "pin_memory": "seconds"}


def remove_stale_locks(root: Path) -> list[Path]:
    """Delete ``<root>/<op>/lock`` files and return their paths."""
    locks = sorted(root.glob("*/lock"))
    for lock in locks:
        lock.unlink(missing_ok=True)
    return locks


def default_ops(accelerator: str) -> list[str]:
    return [op for op in BUILDERS if accelerator == "cpu" or op not in CPU_ONLY]


def build(op: str) -> float:
    """Load ``op`` through the current DeepSpeed accelerator, building it if needed;
    returns the seconds taken.

    Raises:
        RuntimeError: the accelerator has no such op or it cannot be built here.
    """
    from deepspeed.accelerator import get_accelerator
    builder = get_accelerator().create_op_builder(BUILDERS[op])
    if builder is None:
        raise RuntimeError(f"{op}: no {BUILDERS[op]} on the {get_accelerator()._name} accelerator")
    t0 = time.perf_counter()
    builder.load(verbose=False)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ops", nargs="*", metavar="OP",
                        help=f"ops to build, from {sorted(BUILDERS)} (default: those this "
                             "machine's ZeRO runs load)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.ops) - set(BUILDERS))
    if unknown:
        parser.error(f"unknown op(s) {unknown}; valid: {sorted(BUILDERS)}")
    root = use_extensions_dir()
    root.mkdir(parents=True, exist_ok=True)
    for lock in remove_stale_locks(root):
        print(f"removed stale lock {lock}")
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()._name
    print(f"TORCH_EXTENSIONS_DIR={root} (DeepSpeed accelerator: {accelerator})", flush=True)
    failed = []
    for op in args.ops or default_ops(accelerator):
        if any((root / op).glob("*.so")):
            print(f"{op}: built before, loading", flush=True)
        else:
            print(f"{op}: building (once per machine; {FIRST_BUILD[op]} on 2 cores, less on more)...",
                  flush=True)
        try:
            print(f"{op}: loaded in {build(op):.1f} s", flush=True)
        except Exception as e:  # report every op, then fail
            print(f"{op}: FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            failed.append(op)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
