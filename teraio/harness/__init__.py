"""The experiment harness: a point's config composed from Hydra (``compose``) and checked
before anything runs (``checks``), one worker process per run (``launch``, ``run``), drive
locks between sweeps (``drive_lock``) and the modeled roofline experiment (``fig3``).
``teraio.sweep`` is its entry point."""
