"""TeraIO itself (paper §3): the lifetime profiler (``profiler``, producing a ``trace``), the
migration planner (``planner``, Algorithm 1, producing a ``plan``) and the migration engine
(``engine``) with its tiers (``storage``: SSDs and page-locked host memory; ``pager``: on-demand
eviction for the steps before a plan exists; ``probe``: measured tier bandwidths), plus the
performance model (``simulator``, ``roofline``; paper §2.2, Fig. 3) and full-depth traces
synthesized from reduced ones (``synth``). Nothing here knows about configs, systems or sweeps."""
