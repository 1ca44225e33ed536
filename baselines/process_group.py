"""torch.distributed for the baselines that train data-parallel (ZeRO, FSDP2): the process
group of a lone process or of ``torchrun``'s ranks, each rank's share of the global batch
and the loss averaged over ranks."""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(device: torch.device, backend: str, set_device: bool = False) -> bool:
    """Initialise torch.distributed with ``backend`` unless a launcher (torchrun) already
    did; a lone process gets rank 0 of 1 on a free loopback port. ``set_device``: make
    ``device`` the current CUDA device first (on CUDA). Returns True if it initialised it
    here (the caller then destroys it)."""
    if dist.is_initialized():
        return False
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    if set_device and device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    return True


def rank_rows(batch_size: int, world: int) -> slice:
    """This rank's contiguous share of a global batch of ``batch_size`` sequences over
    ``world`` ranks."""
    per_rank = batch_size // world
    rank = dist.get_rank()
    return slice(rank * per_rank, (rank + 1) * per_rank)


def mean_over_ranks(total: torch.Tensor, world: int) -> float:
    """``total`` (this rank's loss, a tensor) averaged over the ``world`` ranks (an
    all-reduce where there are several)."""
    if world > 1:
        dist.all_reduce(total)
        total /= world
    return float(total)
