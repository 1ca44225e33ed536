"""The reference grown call by call: the ordered list of what ``runs/reference/<card>/`` must
hold (``benchmarks/reference.yaml``), which of its rows are missing there, and the sweeps that
run the next ones.

The list (:func:`load_list`) is chunks, each one point of one experiment with the systems that
run alike, their trials and overrides (:class:`Chunk`). A chunk's row of a system and trial is
*done* (:func:`is_done`) when the chunk's sweep folder holds a row of that point, system and
trial which is ok, or failed with its reason (``oom``, ``error``; a ``timeout`` only where its
run had at least the list's ``full_run_s``, the most one device call gives a run); an
``interrupted`` row (the call's budget ended it) or an unreadable one is not. :func:`missing`
lists, in the list's order, the rows not done of every chunk whose part is not held;
:func:`invocations` turns them into ``python -m teraio.sweep`` overrides, one sweep per set of
systems missing the same trials (the sweep runs a failed point again, so a failure that counts
as done is never handed to it).

The card (:func:`card_of`) is named from the GPU, so that rows of one card never mix with
another's: a row under ``runs/reference/<card>/`` made on another card is refused
(:func:`rows_index`).
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Callable

import yaml

from teraio import systems
from teraio.harness.rows import read_row
from teraio.result import POINT_KEYS

LIST_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "reference.yaml"
CARDS = {"NVIDIA H100 80GB HBM3": "h100", "NVIDIA H200": "h200"}
"""The GPUs the reference is made on (``torch.cuda.get_device_name``) -> the folder of their rows."""
DONE = ("ok", "oom", "error")
"""Statuses of a row that is done whatever its time limit (a ``timeout`` is done only with
``full_run_s``: :func:`is_done`)."""
CHUNK_KEYS = {"part", "experiment", "sweep", "point", "systems", "overrides", "trials"}
CONF_EXPERIMENTS = Path(__file__).resolve().parents[2] / "conf" / "experiment"


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One point of one experiment and the systems that run there alike: ``point``, the
    overrides that pick the point (``model=...``, ``fig7.point=...``); ``overrides``, more of
    them for these runs; ``sweep``, the folder of its rows under ``runs/reference/<card>/``."""

    part: str
    experiment: str
    sweep: str
    point: tuple[str, ...]
    systems: tuple[str, ...]
    trials: tuple[int, ...]
    overrides: tuple[str, ...] = ()

    def label(self) -> str:
        return f"{self.part}: {self.experiment} {' '.join(self.point)}"


@dataclasses.dataclass(frozen=True)
class RefList:
    """The list: its chunks in order, the parts held back (not run yet) and ``full_run_s``."""

    chunks: tuple[Chunk, ...]
    held: tuple[str, ...]
    full_run_s: int


@dataclasses.dataclass(frozen=True)
class Missing:
    chunk: Chunk
    system: str
    trial: int


@dataclasses.dataclass(frozen=True)
class Invocation:
    """One ``python -m teraio.sweep -m +experiment=<experiment>`` with ``overrides``, its rows in
    ``sweep``; ``tune_timeout_s``: each tuning candidate's time limit (``sweep.tune.timeout_s``)."""

    experiment: str
    sweep: str
    overrides: tuple[str, ...]
    tune_timeout_s: int

    def line(self) -> str:
        """``EXPERIMENT SWEEP TUNE_TIMEOUT_S OVERRIDE...``: what benchmarks/reference.sh reads."""
        return " ".join([self.experiment, self.sweep, str(self.tune_timeout_s), *self.overrides])


def _strings(value, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and "=" in v and " " not in v for v in value):
        raise ValueError(f"{where}={value!r}: must be a list of overrides KEY=VALUE without spaces")
    return tuple(value)


def _chunk(d, i: int, trials: tuple[int, ...]) -> Chunk:
    where = f"chunks[{i}]"
    if not isinstance(d, dict) or not {"part", "experiment", "sweep", "point", "systems"} <= set(d) \
            or set(d) - CHUNK_KEYS:
        raise ValueError(f"{where}={d!r}: must be a mapping with part, experiment, sweep, point and systems "
                         f"(and optionally overrides, trials); valid keys: {sorted(CHUNK_KEYS)}")
    if not (CONF_EXPERIMENTS / f"{d['experiment']}.yaml").is_file():
        valid = sorted(p.stem for p in CONF_EXPERIMENTS.glob("*.yaml"))
        raise ValueError(f"{where}.experiment={d['experiment']!r}: no such experiment; valid: {valid}")
    bad = [s for s in d["systems"] if s not in systems.names()] if isinstance(d["systems"], list) else d["systems"]
    if bad or not d["systems"]:
        raise ValueError(f"{where}.systems={d['systems']!r}: unknown {bad!r}; valid: {systems.names()}")
    own = d.get("trials", list(trials))
    if not isinstance(own, list) or not own or not all(isinstance(t, int) and t >= 0 for t in own):
        raise ValueError(f"{where}.trials={own!r}: must be a non-empty list of ints >= 0")
    if not isinstance(d["sweep"], str) or not d["sweep"] or "/" in d["sweep"]:
        raise ValueError(f"{where}.sweep={d['sweep']!r}: must be a folder name")
    return Chunk(part=str(d["part"]), experiment=d["experiment"], sweep=d["sweep"],
                 point=_strings(d["point"], f"{where}.point"), systems=tuple(d["systems"]), trials=tuple(own),
                 overrides=_strings(d.get("overrides", []), f"{where}.overrides"))


def load_list(path: Path = LIST_PATH) -> RefList:
    """The list in ``path`` (``benchmarks/reference.yaml``: its comment says what each key is).

    Raises:
        ValueError: a bad key or value, naming it and what is valid: an unknown experiment or
            system, a held part no chunk has, one point and system in two chunks.
    """
    d = yaml.safe_load(Path(path).read_text())
    if not isinstance(d, dict) or set(d) != {"held", "trials", "full_run_s", "chunks"}:
        raise ValueError(f"{path}: must be a mapping of held, trials, full_run_s and chunks; it has "
                         f"{sorted(d) if isinstance(d, dict) else type(d).__name__}")
    trials = d["trials"]
    if not isinstance(trials, list) or not all(isinstance(t, int) and t >= 0 for t in trials) or not trials:
        raise ValueError(f"{path}: trials={trials!r}: must be a non-empty list of ints >= 0")
    if not isinstance(d["full_run_s"], int) or d["full_run_s"] < 1:
        raise ValueError(f"{path}: full_run_s={d['full_run_s']!r}: must be a positive int (seconds)")
    if not isinstance(d["chunks"], list) or not d["chunks"]:
        raise ValueError(f"{path}: chunks={d['chunks']!r}: must be a non-empty list")
    chunks = tuple(_chunk(c, i, tuple(trials)) for i, c in enumerate(d["chunks"]))
    parts = list(dict.fromkeys(c.part for c in chunks))
    held = d["held"] or []
    if not isinstance(held, list) or set(held) - set(parts):
        raise ValueError(f"{path}: held={held!r}: must be a list of the chunks' parts {parts}")
    seen: dict[tuple, int] = {}
    for i, c in enumerate(chunks):
        for s in c.systems:
            key = (c.experiment, c.sweep, c.point, s)
            if key in seen:
                raise ValueError(f"{path}: chunks[{i}] and chunks[{seen[key]}] both run {s} at {c.label()}")
            seen[key] = i
    return RefList(chunks=chunks, held=tuple(held), full_run_s=d["full_run_s"])


def card_of(gpu_name: str) -> str:
    """The card folder of a GPU named ``gpu_name`` (:data:`CARDS`).

    Raises:
        ValueError: a GPU the reference is not made on, naming it and the valid ones.
    """
    if gpu_name not in CARDS:
        raise ValueError(f"GPU {gpu_name!r}: the reference is made on {sorted(CARDS)} only (one folder each: "
                         f"{sorted(set(CARDS.values()))}); add it to teraio.harness.reference.CARDS with a "
                         "folder of its own")
    return CARDS[gpu_name]


def rows_index(sweep_dir: Path, card: str) -> dict[tuple, dict]:
    """The rows of ``sweep_dir``'s job folders (their ``result.json``) by point (a tuple of
    ``teraio.result.POINT_KEYS``); a file that is not a row the analysis reads is left out (its
    point is not done).

    Raises:
        ValueError: a row made on a GPU other than ``card``'s, naming the file.
    """
    out = {}
    for path in sorted(Path(sweep_dir).glob("*/result.json")):
        try:
            row = read_row(path)
        except (OSError, ValueError):
            continue
        gpu = row.get("gpu_name")
        if gpu is not None and CARDS.get(gpu) != card:
            raise ValueError(f"{path}: made on {gpu!r}, not on the card {card!r} whose rows this folder holds "
                             f"({sorted(k for k, v in CARDS.items() if v == card)}); move it to its card's folder")
        out[tuple(row["point"][k] for k in POINT_KEYS)] = row
    return out


def is_done(row: dict | None, full_run_s: int) -> bool:
    """Whether ``row`` settles its point: ok or failed with its reason (``oom``, ``error``), or
    timed out with at least ``full_run_s`` to run (a point that does not fit one call)."""
    if row is None:
        return False
    if row["status"] in DONE:
        return True
    return row["status"] == "timeout" and float((row.get("config") or {}).get("timeout_s") or 0) >= full_run_s


PointOf = Callable[[Chunk], dict]
"""A chunk -> its point's keys (``teraio.result.POINT_KEYS`` less system and trial)."""


def composed_run(chunk: Chunk, system: str):
    """The ``RunConfig`` of ``system``'s trial 0 at ``chunk``'s point, composed as the sweep
    composes it (``teraio.harness.compose``: the experiment's sweeper axes, then the chunk's
    overrides).

    Raises:
        ValueError: the chunk's overrides pick more than one point (an axis of the experiment
            left to its sweep), naming them.
    """
    from hydra import compose, initialize_config_dir

    from teraio.harness.compose import CONF_DIR, job_overrides, register_resolvers, run_config

    register_resolvers()
    overrides = [f"+experiment={chunk.experiment}", *chunk.point, f"system={system}", "trial=0", *chunk.overrides]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        jobs = job_overrides(compose("config", overrides=overrides, return_hydra_config=True))
        if len(jobs) != 1:
            raise ValueError(f"{chunk.label()}: its overrides pick {len(jobs)} points of {chunk.experiment} "
                             f"({[' '.join(j) for j in jobs[:3]]}...); name one value of every axis it sweeps")
        return run_config(compose("config", overrides=list(jobs[0]), return_hydra_config=True))


def composed_point(chunk: Chunk) -> dict:
    """The point's keys (less system and trial) as the sweep composes them (:func:`composed_run`)."""
    return {k: v for k, v in composed_run(chunk, chunk.systems[0]).point().items() if k not in ("system", "trial")}


def missing(ref: RefList, card_dir: Path, card: str, point_of: PointOf = composed_point) -> list[Missing]:
    """The rows not done (:func:`is_done`) of every chunk whose part is not held, in the list's
    order: chunk, then system, then trial."""
    indexes: dict[str, dict] = {}
    out = []
    for chunk in ref.chunks:
        if chunk.part in ref.held:
            continue
        if chunk.sweep not in indexes:
            indexes[chunk.sweep] = rows_index(Path(card_dir) / chunk.sweep, card)
        base = point_of(chunk)
        for system in chunk.systems:
            for trial in chunk.trials:
                key = tuple({**base, "system": system, "trial": trial}[k] for k in POINT_KEYS)
                if not is_done(indexes[chunk.sweep].get(key), ref.full_run_s):
                    out.append(Missing(chunk, system, trial))
    return out


CandidatesOf = Callable[[Chunk, str], int]
"""(chunk, system) -> how many settings the sweep tunes the system over there (0: none)."""


def tuning_candidates(chunk: Chunk, system: str) -> int:
    """How many candidates ``sweep.tune`` measures for ``system`` at ``chunk``'s point
    (``teraio.harness.tune.candidates_of``, at most ``sweep.tune.max_candidates`` of them)."""
    from teraio.harness.tune import candidates_of

    found = candidates_of(composed_run(chunk, system)) or []
    cap = next((int(o.split("=", 1)[1]) for o in chunk.overrides if o.startswith("sweep.tune.max_candidates=")), None)
    return len(found[:cap])


def invocations(ref: RefList, todo: list[Missing], candidates: CandidatesOf = tuning_candidates) -> list[Invocation]:
    """The sweeps that run ``todo`` (:func:`missing`), in its order: per chunk, one per set of
    its systems missing the same trials. Each tuning candidate of a sweep gets ``full_run_s``
    over the most candidates one of its systems has, so that the tuning of a point ends within
    one call (its record is kept for every trial)."""
    out = []
    by_chunk: dict[Chunk, dict[str, list[int]]] = {}
    for m in todo:
        by_chunk.setdefault(m.chunk, {}).setdefault(m.system, []).append(m.trial)
    for chunk, trials in by_chunk.items():
        groups: dict[tuple[int, ...], list[str]] = {}
        for system, ts in trials.items():
            groups.setdefault(tuple(ts), []).append(system)
        for ts, names in groups.items():
            n = max([candidates(chunk, s) for s in names] + [1])
            out.append(Invocation(chunk.experiment, chunk.sweep,
                                  (*chunk.point, f"system={','.join(names)}", f"trial={','.join(map(str, ts))}",
                                   *chunk.overrides), ref.full_run_s // n))
    return out


def status_lines(ref: RefList, todo: list[Missing]) -> list[str]:
    """One line per chunk: its part, point, systems and how many of its rows are done, held
    chunks named as such."""
    left: dict[Chunk, int] = {}
    for m in todo:
        left[m.chunk] = left.get(m.chunk, 0) + 1
    lines = []
    for c in ref.chunks:
        total = len(c.systems) * len(c.trials)
        state = "held" if c.part in ref.held else f"{total - left.get(c, 0)}/{total} done"
        lines.append(f"{c.label()} [{','.join(c.systems)}] -> {c.sweep}: {state}")
    return lines


def gpu_name() -> str:
    """This machine's first GPU's name: torch's, else ``nvidia-smi``'s.

    Raises:
        ValueError: no GPU is visible.
    """
    import subprocess

    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=60).stdout.splitlines()
    except (OSError, subprocess.TimeoutExpired):
        out = []
    if not out or not out[0].strip():
        raise ValueError("no GPU here (torch sees none, nor nvidia-smi): the reference runs on a lent GPU")
    return out[0].strip()


COMMAND_HEAD = """# runs/reference/{card}: the reference, grown call by call on the {card} card

Every row here was made on {gpus} (the rows' `gpu_name`) by one device call each, from the
repository root of the commit in the table below:

```
source scripts/remote_env.sh && BUDGET_S=<s> TAG=<tag> OUT=$OUT bash benchmarks/reference.sh
```

The script ran, within BUDGET_S seconds, the first rows of `benchmarks/reference.yaml` missing
here (`teraio.harness.reference`), each sweep as `python -m teraio.sweep -m +experiment=<experiment>
<overrides> sweep.name=<sweep> sweep.runs_dir=runs/reference/{card} sweep.make_ssd_dirs=true
sweep.analyze=false timeout_s=<s> sweep.tune.timeout_s=<s> sweep.deadline=<end of the budget>`
(the table's sweeps column gives experiment, sweep and overrides), and packed the job folders it
wrote into `<tag>.tar.gz`, unpacked here by `python -m benchmarks.reference unpack <tag>.tar.gz`,
which added the call's row below and its logs to `logs/<tag>/`. What is still missing:
`python -m benchmarks.reference status --card {card}`.

| tag | commit | GPU | BUDGET_S | sweeps started | rows written |
|---|---|---|---|---|---|
"""


def command_row(record: dict, commit: str) -> str:
    """The COMMAND.md table row of one call's ``call.json`` record, made at ``commit``."""
    rows = record.get("rows") or {}
    counts = ", ".join(f"{n} {s}" for s, n in sorted(Counter(rows.values()).items())) or "none"
    sweeps = "; ".join(f"`{line}`" for line in record.get("sweeps") or []) or "none"
    return (f"| {record['tag']} | {commit} | {record['gpu_name']} | {record['budget_s']} | {sweeps} | "
            f"{counts} |\n")


def append_call(command_md: Path, card: str, record: dict, commit: str) -> None:
    """Add one call's row (:func:`command_row`) to ``command_md``, made with its head
    (:data:`COMMAND_HEAD`) where it does not exist yet."""
    command_md = Path(command_md)
    if not command_md.exists():
        command_md.parent.mkdir(parents=True, exist_ok=True)
        gpus = ", ".join(f"`{g}`" for g, c in CARDS.items() if c == card)
        command_md.write_text(COMMAND_HEAD.format(card=card, gpus=gpus))
    with command_md.open("a") as f:
        f.write(command_row(record, commit))
