"""TeraIO itself (paper §3): the lifetime profiler (``profiler``, producing a ``trace``), the
migration planner (``planner``, Algorithm 1, producing a ``plan``, at the tier rates of
``bandwidth``) and the migration engine (``engine``) with its tiers (``tiers``: SSDs and
page-locked host memory; ``pager``: on-demand eviction for the steps before a plan exists;
``probe``: measured tier bandwidths). The performance model that predicts a plan's iteration
is ``teraio.perf``, above this package. Nothing here knows about configs, systems, sweeps or
the performance model."""
