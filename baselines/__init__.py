"""The systems TeraIO is compared with (paper §4.1, and what users switch on today), one
runner each under the registry's contract (``teraio.systems``: ``run(cfg, job_dir, device)``):

* ``ideal``: Ideal, the plain step without offloading, measured where it fits, composed from
  timed phases where one micro-batch fits, modeled from a TeraIO trace elsewhere;
* ``ideal_ac``: Ideal with torchtitan's activation checkpointing;
* ``zero``: DeepSpeed ZeRO-Offload and ZeRO-Infinity;
* ``fsdp_offload``: FSDP2's CPU offload;
* ``torchao_offload``: torchao's CPU-offloaded AdamW;

and what they share: ``checkpointing`` (the users' baselines' options and activation
checkpointing), ``host_memory`` (the host state of a CPU-offloading baseline, checked before
anything is allocated), ``process_group`` (torch.distributed set up for a lone process or
under ``torchrun``, each rank's share of the batch).

They train on the shared layer every system uses (``teraio.config``, ``teraio.result``,
``teraio.workload``, the loop and measurement of ``teraio.systems``), read TeraIO's
tensor-lifetime profiler where they count saved activations (``teraio.core.profiler``) and
the performance model where a modeled Ideal replays a TeraIO trace (``teraio.perf``); never
TeraIO's trainer (``teraio.trainer``) or its engine (``tests/test_layout.py``).
"""
