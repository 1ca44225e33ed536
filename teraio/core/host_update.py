"""The optimizer update where its state lives: AdamW in host memory for the parameters a plan
chooses, their optimizer state kept there (beyond the paper: a fourth option beside keeping a
tensor, moving it and recomputing it; ZeRO-Offload, Ren et al., ATC 2021, and torchao's
``CPUOffloadOptimizer`` do the same for every parameter), instead of carrying that state to
the GPU and back every step.

Each step, for each such parameter (``Trace.with_host_update``'s ``meta["host_update"]``):

* after op ``grad_write`` (its gradient's last write in backward) the gradient is copied to
  page-locked host memory on a side stream, after the ops queued before it; the engine then
  frees the device gradient (the caching allocator keeps its memory until the copy ran);
* a worker thread waits for that copy and runs AdamW on the host copies of the parameter
  and its two moments (torch's fused CPU AdamW, with the device optimizer's
  hyperparameters: ``benchmarks/host_adam.py`` measures the implementations);
* once the update is done and the step is over, the training thread copies the updated
  parameter into the device parameter on another side stream, after every op queued
  before: at the next step's first op for the updates done by then (in the order of their
  first use), else at the first op after the update lands;
* before op ``first_use`` of the next step the compute stream waits for that copy; where the
  update is not done yet the training thread waits for it and copies it first (a stall,
  counted).

Only the training thread writes a device parameter, between the step that used it and the
next one's first use, and through a tensor of its own on the parameter's storage, which
leaves the parameter's version alone: autograd saves op ``first_use``'s inputs before the
op reaches the engine, so where the update is late the copy lands after that save, and a
version bump there would fail the step's backward (on an H100 a worker's copy did, for a
norm weight, the one kind of parameter its own first-use op saves). The save holds the
parameter, not its bytes, and the op's kernel runs after the copy, so forward and backward
read the updated value.

The device optimizer no longer holds these parameters (:func:`take_from_optimizer`), so its
step runs the ops of ``Trace.with_host_update``'s trace. On a CPU device the copies are plain
copies and no stream waits. One instance per engine (``teraio.core.engine``); no
module-level state.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from teraio.core.tiers.pinned import page_unlock, pinned_empty


@dataclasses.dataclass
class Taken:
    """A parameter taken out of a device optimizer (:func:`take_from_optimizer`): its state
    (``step``, ``exp_avg``, ``exp_avg_sq``), its group's hyperparameters, and where it was
    (group index, position) so that :func:`give_back` puts it back in the same order."""

    state: dict
    hyper: dict
    group: int
    position: int


HYPER = ("lr", "betas", "eps", "weight_decay")


def take_from_optimizer(optimizer: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter]) -> dict[str, Taken]:
    """Remove ``params`` (name -> parameter) from ``optimizer`` (a ``torch.optim.AdamW``
    without ``amsgrad`` or ``maximize``) with their state; returns what was taken, by name.

    Raises:
        ValueError: a parameter the optimizer does not hold or has no state for yet (run a
            step first), or an optimizer this update cannot stand in for.
    """
    if not isinstance(optimizer, torch.optim.AdamW):
        raise ValueError(f"a host update stands in for torch.optim.AdamW, not {type(optimizer).__name__}")
    where = {id(p): (g, i) for g, group in enumerate(optimizer.param_groups) for i, p in enumerate(group["params"])}
    out = {}
    for name, p in params.items():
        if id(p) not in where or p not in optimizer.state:
            raise ValueError(f"{name}: not held by the optimizer, or no state yet (a host update takes a "
                             "parameter after the optimizer's first step)")
        g, i = where[id(p)]
        group = optimizer.param_groups[g]
        if group.get("amsgrad") or group.get("maximize"):
            raise ValueError(f"{name}: amsgrad or maximize AdamW has no host update")
        out[name] = Taken(optimizer.state.pop(p), {k: group[k] for k in HYPER}, g, i)
    gone = {id(p) for p in params.values()}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) not in gone]
    return out


def give_back(optimizer: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter], taken: dict[str, Taken]) -> None:
    """Undo :func:`take_from_optimizer`: each parameter back at its place, with ``taken``'s
    state (its tensors wherever they are now, on the parameter's device)."""
    for name in sorted(params, key=lambda n: (taken[n].group, taken[n].position)):
        t = taken[name]
        optimizer.param_groups[t.group]["params"].insert(t.position, params[name])
        optimizer.state[params[name]] = t.state


def measure_rate(nbytes: int = 1 << 26, steps: int = 3) -> float:
    """GB of FP32 parameters that fused CPU AdamW updates per second on this host, the best
    of ``steps`` steps over one parameter of ``nbytes`` (after one untimed step)."""
    p = torch.nn.Parameter(torch.zeros(nbytes // 4))
    p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    opt.step()
    best = float("inf")
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


class _Hosted:
    """One parameter updated in host memory: its host copies, its AdamW, and this step's
    synchronisation with the training thread."""

    def __init__(self, name: str, param: torch.nn.Parameter, taken: Taken, info: dict, host_param: torch.Tensor,
                 pinned: bool):
        self.name, self.param, self.info = name, param, info
        self.host = host_param  # the parameter's dtype and shape
        self.pinned = pinned
        nbytes = param.numel() * param.element_size()
        grad = pinned_empty(nbytes, f"host update gradient of {name}") if pinned \
            else torch.empty(nbytes, dtype=torch.uint8)
        self.grad = grad.view(param.dtype).view(param.shape)
        self.master = torch.nn.Parameter(self.host, requires_grad=False)
        self.master.grad = self.grad
        self.optimizer = torch.optim.AdamW([self.master], fused=True, **taken.hyper)
        self.optimizer.state[self.master] = taken.state
        self.refresh_event: torch.cuda.Event | None = None  # its copy back, on CUDA
        self.job: Future | None = None  # its update, until the copy back is issued


class HostUpdate:
    """AdamW in host memory for a plan's hosted parameters (module docstring), driven by the
    migration engine op by op.

    Args:
        params: name (``"param:<fqn>"``) -> the device parameter, for each hosted parameter.
        taken: name -> what :func:`take_from_optimizer` took (state on the device or in host
            memory; moved to host memory here).
        info: name -> ``Trace.with_host_update``'s entry (``grad``, ``grad_write``,
            ``last_use``, ``first_use``, ``nbytes``).
        device: the training device.
        host_state: name -> (parameter, exp_avg, exp_avg_sq) host tensors to use as they are
            (the pager's copies, already in host memory); others are copied from the device.

    Raises:
        ValueError: ``params``, ``taken`` and ``info`` name different parameters.
    """

    def __init__(self, params: dict[str, torch.nn.Parameter], taken: dict[str, Taken], info: dict[str, dict],
                 device: torch.device, host_state: dict[str, tuple] | None = None):
        if not set(params) == set(taken) == set(info):
            raise ValueError(f"host update: parameters {sorted(params)[:3]}, taken {sorted(taken)[:3]} and traced "
                             f"{sorted(info)[:3]} differ")
        self.device = device
        cuda = device.type == "cuda"
        self.hosted: dict[str, _Hosted] = {}
        for name, p in params.items():
            given = (host_state or {}).get(name)
            state = taken[name].state
            host = _to_host(given[0] if given else p.detach(), cuda)  # page-locked on CUDA
            for key, x in zip(("exp_avg", "exp_avg_sq"), given[1:] if given else (state["exp_avg"], state["exp_avg_sq"])):
                state[key] = x if given else x.detach().to("cpu", copy=True)
            self.hosted[name] = _Hosted(name, p, taken[name], info[name], host, cuda)
        self._at: dict[str, dict[int, list[_Hosted]]] = {"grad_write": {}, "first_use": {}}
        for h in self.hosted.values():
            for key, by_op in self._at.items():
                by_op.setdefault(int(h.info[key]), []).append(h)
        self._d2h = torch.cuda.Stream(device) if cuda else None
        self._h2d = torch.cuda.Stream(device) if cuda else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="teraio-host-adamw")
        self._sent: list[_Hosted] = []  # this step's updates started
        self._due: list[_Hosted] = []  # the last step's, their copies back not issued yet (first-use order)
        self._landed: collections.deque = collections.deque()  # a token per update done since last looked

    @property
    def names(self) -> set[str]:
        return set(self.hosted)

    def grad_names(self) -> dict[str, str]:
        """Gradient name (``op<k>:out<j>``) -> its parameter's name."""
        return {h.info["grad"]: name for name, h in self.hosted.items()}

    # ---- the engine's calls, on the training thread ------------------------------------
    def after(self, k: int, grad_storage) -> None:
        """After op ``k``: send the gradients whose last write it was (``grad_storage(name)``:
        the device storage of gradient ``name``) and start their updates."""
        for h in self._at["grad_write"].get(k, ()):
            h.job = self._pool.submit(self._update, h, self._send(h, grad_storage(h.info["grad"])))
            h.job.add_done_callback(self._landed.append)  # once done (deque appends are atomic)
            self._sent.append(h)

    def before(self, k: int) -> float:
        """Before op ``k``: copy back the last step's updates done by now, and make the
        parameters op ``k`` uses first wait for theirs (the compute stream's wait, or on CPU
        the copy itself); returns the seconds the training thread waited for updates not
        done yet (stalls).

        Raises:
            Exception: what a host update raised.
        """
        if self._due and self._landed:  # an update finished since the last look
            self._landed.clear()  # one finishing after this is looked for at the next op
            for h in [h for h in self._due if h.job.done()]:
                self._refresh(h)
        waited = 0.0
        for h in self._at["first_use"].get(k, ()):
            if h.job is not None:  # none in flight: the engine's first step
                t0 = time.perf_counter()
                if not h.job.done():
                    h.job.result()
                    waited += time.perf_counter() - t0
                self._refresh(h)
            if h.refresh_event is not None:
                torch.cuda.current_stream(self.device).wait_event(h.refresh_event)
                h.refresh_event = None
        return waited

    def end_step(self) -> None:
        """After a step: the hosted parameters hold no gradient (the device optimizer's
        ``zero_grad`` does not reach them; the engine freed their device bytes), and the
        step's updates are due to be copied back (:meth:`before`)."""
        for h in self.hosted.values():
            h.param.grad = None
        self._due = sorted(self._due + self._sent, key=lambda h: h.info["first_use"])
        self._sent = []

    def close(self) -> None:
        """Finish the updates in flight, leave every device parameter at its updated value
        (a step that failed after sending a gradient included), and release the host
        buffers. Idempotent.

        Raises:
            Exception: the first error a host update raised, once the others are finished.
        """
        if self._pool is None:
            return
        self._due = sorted(self._due + self._sent, key=lambda h: h.info["first_use"])
        self._sent = []
        errors = []
        for h in list(self._due):
            try:
                self._refresh(h)
            except Exception as e:  # keep finishing the others, then report
                errors.append(e)
        self._pool.shutdown(wait=True)
        self._pool = None
        if self._h2d is not None:
            self._h2d.synchronize()
        for h in self.hosted.values():
            h.refresh_event = None
            if h.pinned:
                for buf in (h.grad, h.host):
                    page_unlock(buf.view(torch.uint8).view(-1))
        if errors:
            raise errors[0]

    def states(self) -> dict[str, dict]:
        """Name -> the AdamW state in host memory (``step``, ``exp_avg``, ``exp_avg_sq``), after
        :meth:`close`: to hand the parameters back to a device optimizer."""
        return {name: h.optimizer.state[h.master] for name, h in self.hosted.items()}

    # ---- copies and the update -------------------------------------------------------------
    def _send(self, h: _Hosted, storage: torch.UntypedStorage) -> torch.cuda.Event | None:
        grad = torch.empty(0, dtype=h.param.dtype, device=storage.device).set_(storage).view(h.param.shape)
        if self._d2h is None:
            h.grad.copy_(grad)
            return None
        self._d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._d2h):
            h.grad.copy_(grad, non_blocking=True)
            sent = torch.cuda.Event()
            sent.record(self._d2h)
        grad.record_stream(self._d2h)  # its memory is reused only after the copy ran
        return sent

    def _update(self, h: _Hosted, sent: torch.cuda.Event | None) -> None:
        """On the worker thread: the update once the gradient is in host memory. It touches
        no device tensor (module docstring)."""
        if sent is not None:
            sent.synchronize()
        h.optimizer.step()

    def _refresh(self, h: _Hosted) -> None:
        """On the training thread: copy ``h``'s updated parameter into the device parameter,
        after every op queued so far (on CUDA, on the copy-back stream; ``h.refresh_event``
        marks its end); ``h`` is then no longer due.

        Raises:
            Exception: what its update raised (``h`` is no longer due either way).
        """
        job, h.job = h.job, None
        if h in self._due:
            self._due.remove(h)
        job.result()
        p = h.param
        into = torch.empty(0, dtype=p.dtype, device=p.device).set_(p.untyped_storage(), p.storage_offset(),
                                                                    p.shape, p.stride())  # its own version
        if self._h2d is None:
            into.copy_(h.host)
            return
        self._h2d.wait_stream(torch.cuda.current_stream(self.device))  # after the last step's uses
        with torch.cuda.stream(self._h2d):
            into.copy_(h.host, non_blocking=True)
            h.refresh_event = torch.cuda.Event()
            h.refresh_event.record(self._h2d)


def _to_host(x: torch.Tensor, pinned: bool) -> torch.Tensor:
    """A host copy of ``x``, page-locked where ``pinned``."""
    if not pinned:
        return x.to("cpu", copy=True)
    buf = pinned_empty(x.numel() * x.element_size(), "host update parameter").view(x.dtype).view(x.shape)
    buf.copy_(x)
    return buf
