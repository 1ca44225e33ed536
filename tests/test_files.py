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


def test_a_dead_process_scratch_files_and_dirs_are_removed_and_zero_names_its_swap_dir_so(tmp_path, capsys):
    import subprocess
    import sys
    from pathlib import Path

    from teraio.files import SWAP_DIRS, owner_tag, remove_orphans
    from baselines.zero import swap_dir_of

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    swap = swap_dir_of(tmp_path, Path("runs/x/llama3_tiny-zero_infinity-t0"))
    assert swap.name.startswith(f"{SWAP_DIRS[0]}{owner_tag()}-llama3_tiny-zero_infinity-t0-")
    left = tmp_path / swap.name.replace(f"-{os.getpid()}-", f"-{dead.pid}-")  # as a killed run left it
    for d in (swap, left, tmp_path / f"zero-otherhost-{dead.pid}-p-1"):
        d.mkdir()
        (d / "optimizer.swp").write_bytes(b"z" * 300)
    assert remove_orphans(tmp_path, *SWAP_DIRS) == [str(left)]
    assert sorted(os.listdir(tmp_path)) == sorted([swap.name, f"zero-otherhost-{dead.pid}-p-1"])
    assert f"removed {left} (300 B), left by process {dead.pid}, which is gone" in capsys.readouterr().out
    assert remove_orphans(tmp_path / "absent", *SWAP_DIRS) == []


def test_an_atomic_write_gets_the_mode_of_a_plain_write(tmp_path):
    old = os.umask(0o022)
    try:
        write_atomic(tmp_path / "result.json", b"{}")
        (tmp_path / "plain.json").write_bytes(b"{}")
    finally:
        os.umask(old)
    assert oct((tmp_path / "result.json").stat().st_mode & 0o777) == oct((tmp_path / "plain.json").stat().st_mode & 0o777) == "0o644"
