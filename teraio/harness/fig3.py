"""Paper Fig. 3 from saved traces, on CPU, modeled (``conf/experiment/fig3.yaml``):

    python -m teraio.harness.fig3 +experiment=fig3

No worker and no GPU: each model's saved trace is planned and replayed by the
performance model at every bandwidth (:mod:`teraio.perf.roofline`). The GPU capacity per model
is the paper's memory pressure M (its Fig. 7 tables): capacity = the trace's
un-offloaded peak / M. Outputs (``teraio.perf.roofline.OUTPUT_FILES``) go to the run
directory, ``<sweep.runs_dir>/<sweep.name>/``.
"""
from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import to_absolute_path
from omegaconf import DictConfig
from rich.console import Console

from teraio.core.trace import Trace
from teraio.perf.jobdir import read_trace
from teraio.perf.roofline import roofline, save_roofline

console = Console(highlight=False, emoji=False)


def check_models(section: DictConfig) -> dict[str, tuple[Path, float]]:
    """``{name: (trace file, paper_m)}`` of the models of ``roofline.models`` whose ``trace``
    is not null, each file found (a relative path is taken from the directory the command
    runs in); nothing is read.

    Raises:
        ValueError: a trace path that does not exist (naming it and where it was looked for),
            ``paper_m`` <= 100 (a model that fits needs no offloading and has no roofline), or
            every trace null.
    """
    found = {}
    for name, spec in section.items():
        if spec.trace is None:
            continue
        path = Path(to_absolute_path(str(spec.trace)))
        if not path.is_file():
            raise ValueError(f"roofline.models.{name}.trace={spec.trace}: no such file ({path}; a relative path "
                             f"is taken from the directory the command runs in, {Path.cwd()}): run from the "
                             "repository root, or give a saved trace (.json or .json.gz), or null to leave the "
                             "model out")
        if not float(spec.paper_m) > 100:
            raise ValueError(f"roofline.models.{name}.paper_m={spec.paper_m}: must be > 100 "
                             "(percent of the GPU capacity)")
        found[name] = (path, float(spec.paper_m))
    if not found:
        raise ValueError("roofline.models: every trace is null; nothing to plot")
    return found


def load_models(section: DictConfig) -> tuple[dict[str, Trace], dict[str, int]]:
    """Traces and capacities (bytes) of ``roofline.models``: ``{name: {trace, paper_m}}``,
    ``paper_m`` in percent. A model whose ``trace`` is null is left out (no trace yet).

    Raises:
        ValueError: as :func:`check_models`, or a damaged trace (naming it,
            ``teraio.perf.jobdir.read_trace``).
    """
    for name, spec in section.items():
        if spec.trace is None:
            console.print(f"[yellow]{name}: roofline.models.{name}.trace is null, left out "
                          "(no trace yet)[/yellow]")
    traces, caps = {}, {}
    for name, (path, paper_m) in check_models(section).items():
        traces[name] = read_trace(path)
        caps[name] = int(traces[name].peak_bytes() / (paper_m / 100))
    return traces, caps


def run(cfg: DictConfig, out_dir: Path):
    """Make the roofline of ``cfg.roofline`` (see ``conf/experiment/fig3.yaml``) in
    ``out_dir``; returns the table.

    Raises:
        ValueError: no ``roofline`` section (run with ``+experiment=fig3``), or as
            :func:`load_models` and :func:`teraio.perf.roofline.roofline`.
    """
    if "roofline" not in cfg:
        raise ValueError("no `roofline` section in the config; run with +experiment=fig3")
    r = cfg.roofline
    traces, caps = load_models(r.models)
    df = roofline(traces, caps, tuple(float(b) for b in r.bandwidths_gbps), policies=tuple(r.policies))
    paths = save_roofline(df, out_dir, policy=r.policies[0])
    console.print(df.pivot_table(index="bandwidth_gbps", columns=["model", "policy"],
                                 values="normalized_throughput", dropna=False).round(3).to_string(),
                  markup=False)
    console.print("wrote " + ", ".join(str(p) for p in paths))
    return df


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        run(cfg, Path(HydraConfig.get().runtime.output_dir))
    except ValueError as e:
        raise SystemExit(f"teraio.harness.fig3: {e}") from e


if __name__ == "__main__":
    _hydra_main()
