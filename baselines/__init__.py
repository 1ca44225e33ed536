"""The paper's baselines as system runners (``run(cfg, job_dir, device)`` returning
``teraio.result.Measurements``, see ``teraio.systems``): ``ideal`` (no memory limit, no
offload) and ``zero`` (DeepSpeed ZeRO-Offload and ZeRO-Infinity)."""
