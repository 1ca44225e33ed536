"""The paper's baselines as system runners (``run(cfg, job_dir, result, device)``, see
``teraio.run``): ``ideal`` (no memory limit, no offload) and ``zero`` (DeepSpeed
ZeRO-Offload and ZeRO-Infinity)."""
