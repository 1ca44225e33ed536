"""The job folders a device call wrote, packed for the trip back and unpacked where they belong
(``benchmarks/reference.sh``, ``python -m benchmarks.reference``).

The unit is a sweep folder's top-level entry (a job folder, ``tuning/``, ``multirun.yaml``): one
that holds a file changed since the call began is packed whole and, unpacked, replaces the
entry of the same name, so that what a rerun moved (a failed attempt's files into
``attempt.<n>/``) is where the device left it. Dot files (locks, temporaries) stay behind. A
trace, plan, op log or transfer log is packed gzipped (``<name>.gz``, as the committed rows keep
them), and a ``.gz`` beside its fresh uncompressed file is left out (stale). The archive also
holds ``call.json``: the record the caller gives, with ``entries``, the ``<sweep>/<entry>``
packed.
"""
from __future__ import annotations

import gzip
import io
import json
import shutil
import tarfile
import tempfile
from pathlib import Path

GZIPPED = ("trace.json", "plan.json", "oplog.csv", "transfers.csv")
RECORD = "call.json"


def _files(entry: Path) -> list[Path]:
    """The files of ``entry`` (itself, if a file) but dot files and what lies in dot folders."""
    found = [entry] if entry.is_file() else sorted(p for p in entry.rglob("*") if p.is_file())
    return [p for p in found if not any(part.startswith(".") for part in p.relative_to(entry.parent).parts)]


def touched(sweep_dir: Path, since: float) -> list[str]:
    """Names of ``sweep_dir``'s top-level entries holding a file (dot files aside) modified
    after ``since`` (a Unix time); none where the folder does not exist."""
    if not Path(sweep_dir).is_dir():
        return []
    return [e.name for e in sorted(Path(sweep_dir).iterdir()) if not e.name.startswith(".")
            and any(f.stat().st_mtime > since for f in _files(e))]


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def touched_entries(card_dir: Path, sweeps: list[str], since: float) -> list[str]:
    """``<sweep>/<entry>`` of every entry of ``card_dir``'s ``sweeps`` touched after ``since``
    (:func:`touched`), in the sweeps' order."""
    return [f"{s}/{e}" for s in dict.fromkeys(sweeps) for e in touched(Path(card_dir) / s, since)]


def pack(card_dir: Path, entries: list[str], archive: Path, record: dict, logs: dict[str, Path] | None = None) -> None:
    """Pack the ``entries`` of ``card_dir`` (:func:`touched_entries`) into the gzipped tar
    ``archive`` (module docstring), with ``record`` as ``call.json`` and each file of ``logs``
    (entry name -> file, e.g. ``logs/<tag>/<name>.log``) as an entry; ``call.json``'s
    ``entries`` lists them all."""
    card_dir = Path(card_dir)
    logs = logs or {}
    with tarfile.open(archive, "w:gz") as tar:
        _add(tar, RECORD, json.dumps({**record, "entries": list(entries) + list(logs)}, indent=1).encode())
        for name, path in logs.items():
            tar.add(path, arcname=name)
        for entry in entries:
            for f in _files(card_dir / entry):
                name = str(f.relative_to(card_dir))
                if f.name in GZIPPED:
                    _add(tar, f"{name}.gz", gzip.compress(f.read_bytes(), mtime=0))
                elif not (f.suffix == ".gz" and f.with_suffix("").exists()):
                    tar.add(f, arcname=name)


def read_record(archive: Path) -> dict:
    """The ``call.json`` record of an archive made by :func:`pack`.

    Raises:
        ValueError: it has none.
    """
    with tarfile.open(archive, "r:gz") as tar:
        try:
            return json.loads(tar.extractfile(RECORD).read())
        except KeyError:
            raise ValueError(f"{archive}: no {RECORD}; is it an archive of benchmarks/reference.sh?") from None


def unpack(archive: Path, card_dir: Path) -> dict:
    """Unpack ``archive`` (made by :func:`pack`) into ``card_dir``: each packed entry replaces
    the entry of that name; return its ``call.json`` record.

    Raises:
        ValueError: the archive has no ``call.json``, or a member outside its entries (an
            absolute path, ``..``, a link), naming it.
    """
    card_dir = Path(card_dir)
    record = read_record(archive)
    entries = record.get("entries") or []
    with tarfile.open(archive, "r:gz") as tar, tempfile.TemporaryDirectory() as tmp:
        members = tar.getmembers()
        for m in members:
            inside = m.name == RECORD or any(m.name == e or m.name.startswith(f"{e}/") for e in entries)
            if not (m.isfile() or m.isdir()) or not inside or ".." in Path(m.name).parts:
                raise ValueError(f"{archive}: member {m.name!r} is not a file of its entries {entries}")
        tar.extractall(tmp, members=[m for m in members if m.name != RECORD], filter="data")
        for entry in entries:
            if not (Path(tmp) / entry).exists():  # an entry whose every file was left out
                continue
            dest = card_dir / entry
            if dest.is_dir():
                shutil.rmtree(dest)
            elif dest.exists():
                dest.unlink()
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(Path(tmp) / entry), dest)
    return record
