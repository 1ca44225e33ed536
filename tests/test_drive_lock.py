"""One drive-bound run at a time per drive (teraio.harness.drive_lock), and the sweep holding the
lock while a worker of an SSD system runs."""
from __future__ import annotations

import json
import sys
import tempfile
import threading

import pytest

from teraio.harness.drive_lock import hold_drives, lock_path
from test_sweep import run_sweep

WAIT_S = 30  # bound on waits for another thread; never reached when the lock works


@pytest.fixture(autouse=True)
def own_lock_dir(tmp_path, monkeypatch):
    """The drive locks of these tests, and of the sweeps they start, in a temporary directory of
    their own (the locks live in ``tempfile.gettempdir()``): another sweep of the host on the
    same drive holds the host's (a fresh-clone CI beside a smoke-sweep loop failed here)."""
    locks = tmp_path / "locks"
    locks.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(locks))  # this process (tempfile caches its directory)
    monkeypatch.setenv("TMPDIR", str(locks))  # the sweeps' processes


def test_directories_on_one_drive_share_one_lock(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b" / "c").mkdir(parents=True)
    assert lock_path(tmp_path / "a") == lock_path(tmp_path / "b" / "c")
    with hold_drives([tmp_path / "a", tmp_path / "b" / "c"]) as held:
        assert held == [lock_path(tmp_path)]


def test_second_holder_waits_until_the_first_releases(tmp_path):
    waited, entered = threading.Event(), threading.Event()

    def second() -> None:
        with hold_drives([tmp_path], on_wait=lambda path: waited.set()):
            entered.set()

    with hold_drives([tmp_path]):
        t = threading.Thread(target=second)
        t.start()
        assert waited.wait(WAIT_S)  # it found the lock taken ...
        assert not entered.is_set()  # ... and did not go on
    t.join(WAIT_S)
    assert entered.is_set() and not t.is_alive()


def test_free_drive_is_taken_without_waiting(tmp_path):
    calls = []
    with hold_drives([tmp_path], on_wait=calls.append):
        pass
    with hold_drives([tmp_path], on_wait=calls.append):
        pass
    assert calls == []


def test_missing_directory_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=str(tmp_path / "nope")):
        with hold_drives([tmp_path / "nope"]):
            pass


# A worker that reports whether the lock of its SSD directory's drive was held while it ran.
PROBE_WORKER = '''
import fcntl, sys
from pathlib import Path
from teraio.config import load_run_config
from teraio.harness.drive_lock import lock_path
from teraio.result import Measurements, result_row, write_result
resolved = Path(sys.argv[1])
cfg = load_run_config(resolved)
with open(lock_path(cfg.hardware.ssd_dirs[0]), "a") as f:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held = False
    except BlockingIOError:
        held = True
row = result_row(cfg.point(), cfg.to_dict(), Measurements(iterations=[
    {"step": 0, "seconds": 0.5, "tokens": 100, "tokens_per_s": 200.0, "loss": 1.0, "stall_count": 0,
     "stall_seconds": 0.0}]), status="ok", error="lock held" if held else "lock free")
write_result(resolved.parent / "result.json", row)
'''


@pytest.mark.parametrize("system,exclusive,expected", [
    ("teraio_ssd", "true", "lock held"),
    ("teraio_ssd", "false", "lock free"),
    ("ideal", "true", "lock free"),  # Ideal moves nothing through a drive
])
def test_sweep_holds_the_drive_while_an_ssd_system_runs(tmp_path, system, exclusive, expected):
    script = tmp_path / "probe_worker.py"
    script.write_text(PROBE_WORKER)
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    runs = tmp_path / "runs"
    p = run_sweep(runs, {}, f"{sys.executable} {script}", "trial=0", f"system={system}",
                  f"hardware.ssd_dirs=[{ssd}]", f"sweep.exclusive_drives={exclusive}")
    assert p.returncode == 0, p.stdout + p.stderr
    job = next((runs / "smoke").glob(f"*-{system}-*-t0"))
    result = json.loads((job / "result.json").read_text())
    assert result["error"] == expected
