"""Trace arithmetic that the planner starts from (``teraio.core.trace``)."""
from __future__ import annotations

import numpy as np
import pytest

from teraio.core.trace import TensorRecord, Trace


def grads_trace(op_allocated=None, optimizer_ops=(4, 8)):
    tensors = [TensorRecord(0, "param:w", 100, "param", True, [0, 5]),
               TensorRecord(1, "op1:out0", 40, "grad", False, [1, 4]),
               TensorRecord(2, "op2:out0", 60, "grad", False, [2, 6]),
               TensorRecord(3, "op3:out0", 10, "temp", False, [3, 4])]
    meta = {} if optimizer_ops is None else {"optimizer_ops": list(optimizer_ops)}
    return Trace([f"op{k}" for k in range(9)], np.full(9, 1e-3), tensors, meta, op_allocated)


def test_held_grad_bytes_run_from_last_use_to_the_end_of_the_optimizer_step():
    # grad 1 is last used at op 4 and grad 2 at op 6; optimizer.step covers ops 4..7.
    assert grads_trace().held_grad_bytes().tolist() == [0, 0, 0, 0, 0, 40, 40, 100, 0]


def test_released_grads_lower_the_allocator_floor_by_the_held_bytes():
    plain = grads_trace()
    allocated = plain.live_bytes() + plain.held_grad_bytes() + 7
    trace = grads_trace(op_allocated=allocated)
    released = trace.with_released_grads()
    assert released.op_allocated_bytes.tolist() == (allocated - trace.held_grad_bytes()).tolist()
    assert released.required_bytes().tolist() == (plain.live_bytes() + 7).tolist()
    assert released.meta["released_grads"] and "released_grads" not in trace.meta


def test_released_grads_of_a_cpu_trace_is_the_trace():
    trace = grads_trace()
    assert trace.with_released_grads() is trace


def test_held_grads_need_the_optimizer_ops_or_an_end():
    with pytest.raises(ValueError, match="optimizer_ops"):
        grads_trace(optimizer_ops=None).with_released_grads()
    assert grads_trace(optimizer_ops=None).held_grad_bytes(end=8).tolist() == \
        grads_trace().held_grad_bytes().tolist()
