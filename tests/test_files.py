"""Atomic file writes (teraio/files.py): a failed write leaves the old file and no litter."""
import os

import pytest

from teraio.files import write_atomic


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "plan.json"
    write_atomic(path, b"old")

    def refuse(tmp, dst):
        assert os.path.dirname(tmp) == str(tmp_path) and open(tmp, "rb").read() == b"new"
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        write_atomic(path, b"new", commit=refuse)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["plan.json"]
    write_atomic(path, b"new")
    assert path.read_bytes() == b"new" and os.listdir(tmp_path) == ["plan.json"]
