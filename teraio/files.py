"""Writing a file so that a reader never sees it half-written, and naming the scratch files
of a process so that a later run can remove what it left when it died."""
from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path


def _umask() -> int:
    """The process's umask, read without setting it (Linux ``/proc``) where possible."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: str | Path, data: bytes, commit=os.replace) -> None:
    """Write ``data`` to a temporary file beside ``path`` (a unique name, so concurrent
    writers never share one) and ``commit(tmp, path)`` it — by default ``os.replace``,
    atomic on one filesystem. The file gets the mode a plain ``open`` would give it
    (0666 less the umask), not the temporary file's 0600. The temporary file is removed
    if anything fails."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            f.write(data)
        commit(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# The scratch entries that runs leave on the drives, as (prefix, suffix): TeraIO's SSD slot
# files (teraio.core.tiers.ssd) and ZeRO-Infinity's swap directories (baselines.zero).
SLOT_FILES = ("teraio-", ".slots")
SWAP_DIRS = ("zero-", "")
SCRATCH = (SLOT_FILES, SWAP_DIRS)


def owner_tag() -> str:
    """``<host>-<pid>`` of this process (``-`` in the host name made ``_``): a scratch file
    or directory named ``<prefix><owner_tag()>-...`` is removed by :func:`remove_orphans`
    once this process is gone."""
    return f"{socket.gethostname().replace('-', '_')}-{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _size(path: str) -> int:
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def remove_orphans(directory: str | Path, prefix: str, suffix: str = "") -> list[str]:
    """Delete the entries of ``directory`` named ``<prefix><host>-<pid>-...<suffix>``
    (:func:`owner_tag`) that a process of this host left when it died (its pid is gone),
    files or whole directories, printing a line for each; entries of live processes and of
    other hosts stay, and so does a directory that does not exist. Returns the deleted paths."""
    host = socket.gethostname().replace("-", "_")
    gone = []
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return gone
    for name in names:
        parts = name[len(prefix):].split("-") if name.startswith(prefix) else []
        if len(parts) < 3 or not name.endswith(suffix) or parts[0] != host or not parts[1].isdigit():
            continue
        if _alive(int(parts[1])):
            continue
        path = os.path.join(directory, name)
        try:
            size = _size(path)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:  # another run removed it first
            continue
        print(f"removed {path} ({size} B), left by process {parts[1]}, which is gone", flush=True)
        gone.append(path)
    return gone
