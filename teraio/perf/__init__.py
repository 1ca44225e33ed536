"""The performance model (paper §2.2, Fig. 3): predicting an iteration's time from a trace and
a plan at given bandwidths, without a GPU.

``simulator`` replays a :class:`~teraio.core.trace.Trace` under a
:class:`~teraio.core.plan.MigrationPlan`; ``choose`` keeps, of the plans two planner settings
give (``host_arena``, ``recompute``: ``"auto"``), the one that simulates faster; ``roofline``
sweeps bandwidths (Fig. 3); ``synth`` makes full-depth traces from reduced-depth profiles.
``jobdir`` reads a run's job folder (its config, row, trace and plan); ``replay`` plans a
committed trace again at its plan's settings and simulates a run's plan beside its measured
iterations; ``replan`` sets a committed plan beside the current planner's.

Layering: this package sits above ``teraio.core`` and imports it (traces, plans, the planner,
the bandwidth types in ``teraio.core.bandwidth``); ``teraio.core`` never imports it. The
planner makes one plan per setting; where a setting is to be chosen by simulating, the
choice is made here (``teraio.perf.choose.plan_fastest``), so the planner needs no
simulator and there is no import circle.
"""
