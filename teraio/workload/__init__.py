"""What every system trains (paper §4.1): the models (``models``, torchtitan 0.2.2), the
training step (``step``: synthetic tokens, micro-batches, FP32 AdamW) and its pipelined form
(``pipeline``: stages of a 1F1B pipeline)."""
