"""TeraIO's run (``teraio_ssd`` and ``teraio_mixed``): the registry's runner (``runner``),
the run as a class of a method per phase (``trainer``: page, profile, plan, migrate), its
``system.options`` (``options``), the machine it sets up (``machine``: capacity, tiers and
their rates), the engine's per-step logs (``logs``) and the micro-batch search
(``microbatch``, ``workload.micro_batch_size=auto``).

It drives the paper's three parts (``teraio.core``) and the performance model
(``teraio.perf``) around the shared training step and loop; it never imports the systems
TeraIO is compared with (``baselines``; ``tests/test_layout.py``).
"""
