"""The offload tiers of the migration engine (paper §3.3, Fig. 4), one module per object:
``base`` (``Tier``, the contract and the checks every transfer opens with; ``Transfer``, the
future a transfer returns; ``byte_view``), ``ssd`` (``SSDTier``: SSDs striped with
``O_DIRECT``; the drives' room), ``host`` (``HostTier``: page-locked host memory under a
cap) and ``pinned`` (page-locking host memory on exactly its bytes)."""
