"""Writing a file so that a reader never sees it half-written."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: str | Path, data: bytes, commit=os.replace) -> None:
    """Write ``data`` to a temporary file beside ``path`` (a unique name, so concurrent
    writers never share one) and ``commit(tmp, path)`` it — by default ``os.replace``,
    atomic on one filesystem. The temporary file is removed if anything fails."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        commit(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
