"""A signal whose exception Python drops still stops the run at its next step."""
from __future__ import annotations

import subprocess
import sys
import textwrap

# A SIGTERM that arrives inside a weakref callback (the pager's run many per step): the
# handler's exception is raised there and Python drops it; the loop must still end.
SCRIPT = textwrap.dedent("""
    import os, signal, weakref
    import torch
    from teraio.config import WorkloadConfig
    from teraio.interrupt import Interrupted, raise_on_signals
    from teraio.systems.loop import Step, measure_steps

    raise_on_signals()

    class Storage:
        pass

    def on_death(_):
        os.kill(os.getpid(), signal.SIGTERM)
        sum(range(100))  # the handler runs here, inside the callback

    s = Storage()
    ref = weakref.ref(s, on_death)
    del s  # the callback runs here, and its SIGTERM's exception is dropped
    ran = []
    try:
        measure_steps(lambda step: ran.append(step) or Step(run=lambda: 1.0),
                      WorkloadConfig(warmup_steps=1, measure_steps=3),
                      torch.device("cpu"), progress=False)
        print("steps ran:", ran)
    except Interrupted as e:
        print("raised:", e, "steps ran:", ran)
""")


def test_a_signal_dropped_inside_a_weakref_callback_stops_the_loop_at_its_next_step():
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "Exception ignored" in p.stderr  # Python did drop the handler's exception
    assert p.stdout.splitlines()[-1] == "raised: interrupted by SIGTERM steps ran: []", p.stdout + p.stderr
