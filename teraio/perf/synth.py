"""Full-depth traces from reduced-depth profiles, and a toy layered trace.

Models too large for one GPU (Llama3-70B) cannot be profiled whole, but a model with the
same width and fewer layers can. :func:`synthesize_layers` turns the trace of an
``L``-layer profile into the trace of the ``L'``-layer model by replicating the per-layer
op pattern.

Assumption: identical layers
----------------------------
Every transformer block runs the same ops, on tensors of the same sizes, for the same
time, and talks only to its neighbours (its input comes from the layer before it in the
sweep, its output goes to the next). Everything outside the blocks (embedding, final
norm, output, loss, the optimizer's non-layer parameters) is unchanged.

How layers are found
--------------------
Persistent tensors named ``param:layers.<i>.<...>`` / ``optim:layers.<i>.<...>`` /
``buffer:layers.<i>.<...>`` (the profiler's names, ``teraio.core.profiler``) label the ops that
touch them with layer ``i``. Wherever the label steps from layer ``a`` to ``a +- 1``, the
op-name sequence must repeat with some period ``P``: op ``k + P`` has op ``k``'s name and
touches the same parameters of the next layer. The smallest such ``P`` around each step
is the block length; consecutive steps with the same ``P`` and direction form a *sweep*
(forward: ascending layers; backward: descending; optimizer step: ascending), whose
``L`` blocks are ``P`` ops each. Block boundaries are placed where the repetition begins,
so ops that run before a layer's first parameter use (e.g. a residual add in backward)
belong to their layer.

How tensors are replicated
--------------------------
A tensor belongs to the block of its first use (a layer parameter or optimizer state: to
its named layer). Layers ``0 .. L-2`` keep their numbers, layer ``L-1`` becomes ``L'-1``,
and the ``L' - L`` inserted layers copy the tensors of the *first* block of each sweep
(layer 0 forward, layer ``L-1`` backward): those are the blocks whose outputs flow to
another block, as a middle layer's do. A tensor's uses ``d`` layers away from its own
layer stay ``d`` layers away; uses outside every block (e.g. an op over all gradients)
stay where they are. A tensor made outside the blocks and used by every layer at the
same offsets (e.g. the RoPE table) is used by the inserted layers too. Op indices and
intermediate names (``op<k>:out<j>``) are renumbered; inserted layers' op times are the
mean over the profiled layers at the same offset.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

from teraio.core.trace import TensorRecord, Trace

_LAYER = re.compile(r"^(param|optim|buffer):layers\.(\d+)\.")
_INTERMEDIATE = re.compile(r"^op(\d+):out(\d+)$")


@dataclasses.dataclass(frozen=True)
class Sweep:
    """``n_layers`` consecutive blocks of ``period`` ops from op ``start``; ``direction``
    +1 visits layers 0..L-1, -1 visits L-1..0."""

    start: int
    period: int
    direction: int
    n_layers: int

    @property
    def stop(self) -> int:
        return self.start + self.period * self.n_layers

    def first_layer(self, n_layers: int) -> int:
        return 0 if self.direction > 0 else n_layers - 1


def tensor_layer(name: str) -> int | None:
    """Layer index of a persistent layer tensor's name, None for anything else."""
    m = _LAYER.match(name)
    return int(m.group(2)) if m else None


def _strip_layer(name: str) -> str:
    return _LAYER.sub(r"\1:layers.*.", name)


def _op_labels(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """Per op: the layer of the layer tensors it touches (-1 none, -2 several layers), and
    an id of the set of those tensors' names with the layer number stripped."""
    n = trace.n_ops
    lab = np.full(n, -1, dtype=np.int64)
    touched: list[set[str]] = [set() for _ in range(n)]
    for t in trace.tensors:
        layer = tensor_layer(t.name) if t.persistent else None
        if layer is None:
            continue
        stripped = _strip_layer(t.name)
        for u in t.uses:
            lab[u] = layer if lab[u] in (-1, layer) else -2
            touched[u].add(stripped)
    ids: dict[frozenset, int] = {frozenset(): 0}
    sig = np.array([ids.setdefault(frozenset(s), len(ids)) for s in touched], dtype=np.int64)
    return lab, sig


def find_sweeps(trace: Trace, n_layers: int) -> list[Sweep]:
    """The layer sweeps of ``trace`` (see the module docstring), in op order.

    Raises:
        ValueError: the layer tensors do not name layers ``0 .. n_layers-1``, or an op that
            touches a layer's tensors lies outside every sweep (the trace is not
            layer-periodic there).
    """
    if n_layers < 2:
        raise ValueError(f"n_layers={n_layers}: need a profile of at least 2 layers to find the period")
    lab, sig = _op_labels(trace)
    found = sorted({int(x) for x in lab if x >= 0})
    if found != list(range(n_layers)):
        raise ValueError(f"the trace's layer tensors name layers {found}, expected 0..{n_layers - 1} "
                         f"(names like 'param:layers.<i>.<...>')")
    _, nid = np.unique(np.asarray(trace.op_names), return_inverse=True)
    n = trace.n_ops

    def consistent(period: int, d: int) -> np.ndarray:
        """consistent[j] for j in [0, n - period): op j+period repeats op j one layer on."""
        a, b = slice(0, n - period), slice(period, n)
        la, lb = lab[a], lab[b]
        same_kind = np.where(la >= 0, lb == la + d, lb == la)
        return (nid[a] == nid[b]) & (sig[a] == sig[b]) & same_kind

    labeled = np.flatnonzero(lab >= 0)
    steps = []  # (first labeled op of the later block, period, direction, repeat mask)
    run_start = 0
    for i in range(1, len(labeled)):
        x, prev = labeled[i], labeled[i - 1]
        if lab[x] == lab[prev]:
            continue
        d = int(lab[x] - lab[prev])
        run = labeled[run_start:i]
        run_start = i
        if abs(d) != 1:
            continue
        for y in run[::-1]:  # smallest period first
            if nid[y] != nid[x] or sig[y] != sig[x]:
                continue
            period = int(x - y)
            if x + period > n:
                continue
            core = run[run >= y]
            ok = consistent(period, d)
            if ok[core].all():
                steps.append((int(x), period, d, ok))
                break

    sweeps: list[Sweep] = []
    ranges: list[tuple[int, int]] = []  # feasible block starts of each sweep
    i = 0
    while i < len(steps):
        x, period, d, ok = steps[i]
        chain = [x]
        while (i + 1 < len(steps) and steps[i + 1][1:3] == (period, d)
               and steps[i + 1][0] == chain[-1] + period):
            i += 1
            chain.append(steps[i][0])
        i += 1
        if len(chain) != n_layers - 1:
            continue
        first = chain[0] - period
        last_labeled = _last_labeled_before(labeled, chain[-1]) + period
        # The repeat must hold over L-1 whole periods: a run [r0, r1) of `ok` around the blocks.
        r0 = first
        while r0 > 0 and ok[r0 - 1]:
            r0 -= 1
        r1 = first
        while r1 < len(ok) and ok[r1]:
            r1 += 1
        lo = max(r0, last_labeled - n_layers * period + 1)
        hi = min(first, r1 - (n_layers - 1) * period)
        if lo > hi:
            continue
        sw = Sweep(start=int(lo), period=period, direction=d, n_layers=n_layers)
        if sweeps and sw.start < sweeps[-1].stop + (ranges[-1][1] - ranges[-1][0]):
            continue  # overlaps a sweep already taken (a step between two sweeps)
        sweeps.append(sw)
        ranges.append((int(lo), int(hi)))
    sweeps = _best_rotation(trace, sweeps, ranges)
    covered = np.zeros(n, dtype=bool)
    for sw in sweeps:
        covered[sw.start:sw.stop] = True
    stray = np.flatnonzero((lab >= 0) & ~covered)
    if stray.size:
        k = int(stray[0])
        raise ValueError(f"op {k} ({trace.op_names[k]}) touches layer {lab[k]}'s tensors but lies in no "
                         f"repeating layer block; found sweeps {sweeps}. Is the profile layer-periodic?")
    return sweeps


def _best_rotation(trace: Trace, sweeps: list[Sweep], ranges: list[tuple[int, int]]) -> list[Sweep]:
    """Place each sweep's block boundaries, within the ops where the repeat holds, where
    the fewest uses cross between inside and outside the blocks (a tensor made inside used
    outside, or the reverse). The repeat alone cannot tell a layer's first ops from the
    same ops of the neighbouring code (e.g. the final norm looks like a layer's first norm);
    tensors used across forward and backward can, as they must stay within layers."""
    first = np.concatenate([np.full(len(t.uses), t.uses[0]) for t in trace.tensors])
    every = np.concatenate([np.asarray(t.uses) for t in trace.tensors])
    starts = [lo for lo, _ in ranges]

    def cost() -> int:
        inside = np.zeros(trace.n_ops, dtype=bool)
        for sw, s in zip(sweeps, starts):
            inside[s:s + sw.period * sw.n_layers] = True
        return int((inside[every] != inside[first]).sum())

    for _ in range(2):
        for i, (lo, hi) in enumerate(ranges):
            best = None
            for s in range(lo, hi + 1):
                starts[i] = s
                c = cost()
                if best is None or c < best[0]:
                    best = (c, s)
            starts[i] = best[1]
    return [dataclasses.replace(sw, start=int(s)) for sw, s in zip(sweeps, starts)]


def _last_labeled_before(labeled: np.ndarray, x: int) -> int:
    return int(labeled[np.searchsorted(labeled, x) - 1])


def synthesize_layers(trace: Trace, n_layers_profiled: int, n_layers: int) -> Trace:
    """The trace of the same model with ``n_layers`` layers, from the trace of an
    ``n_layers_profiled``-layer profile (identical layers; see the module docstring).

    Args:
        trace: the reduced-depth profile (``teraio.core.profiler`` names).
        n_layers_profiled: layers in that profile (>= 2).
        n_layers: layers wanted (>= ``n_layers_profiled``).

    Returns:
        a new :class:`Trace`; ``meta["synthesized"]`` records the profile depth and sweeps.

    Raises:
        ValueError: bad layer counts, a trace that is not layer-periodic (see
            :func:`find_sweeps`), or a tensor whose uses would fall outside the model.
    """
    L, Lp = n_layers_profiled, n_layers
    if Lp < L:
        raise ValueError(f"n_layers={Lp} < n_layers_profiled={L}; can only add layers")
    sweeps = find_sweeps(trace, L)
    n = trace.n_ops
    psi = [ell if ell < L - 1 else Lp - 1 for ell in range(L)]  # original layer -> new layer
    inserted = range(L - 1, Lp - 1)

    op_sweep = np.full(n, -1, dtype=np.int64)
    op_layer = np.full(n, -1, dtype=np.int64)
    for si, sw in enumerate(sweeps):
        op_sweep[sw.start:sw.stop] = si
        blocks = (np.arange(sw.start, sw.stop) - sw.start) // sw.period
        op_layer[sw.start:sw.stop] = blocks if sw.direction > 0 else L - 1 - blocks

    # New op sequence: outside ops as they are, each sweep widened to Lp blocks.
    names: list[str] = []
    seconds: list[np.ndarray] = []
    outside_new = np.full(n, -1, dtype=np.int64)
    sweep_new_start: list[int] = []
    k = 0
    for sw in sweeps + [None]:
        end = sw.start if sw is not None else n
        outside_new[k:end] = len(names) + np.arange(end - k)
        names += trace.op_names[k:end]
        seconds.append(trace.op_seconds[k:end])
        if sw is None:
            break
        sweep_new_start.append(len(names))
        times = trace.op_seconds[sw.start:sw.stop].reshape(L, sw.period)
        for pos in range(Lp):
            j = pos if sw.direction > 0 else Lp - 1 - pos
            if j in psi:
                ell = psi.index(j)
                seconds.append(times[ell if sw.direction > 0 else L - 1 - ell])
            else:
                seconds.append(times.mean(axis=0))
            names += trace.op_names[sw.start:sw.start + sw.period]
        k = sw.stop

    def in_layer(u: int, layer: int) -> int:
        """New index of original op u (in a sweep) moved to new layer ``layer``."""
        si = int(op_sweep[u])
        sw = sweeps[si]
        if not 0 <= layer < Lp:
            raise ValueError(f"a use at op {u} would fall in layer {layer}, outside 0..{Lp - 1}")
        pos = layer if sw.direction > 0 else Lp - 1 - layer
        return sweep_new_start[si] + pos * sw.period + (u - sw.start) % sw.period

    rows = []
    for t in trace.tensors:
        if t.persistent:
            own = tensor_layer(t.name)
        elif t.kind == "input" or op_sweep[t.uses[0]] < 0:
            own = None
        else:
            own = int(op_layer[t.uses[0]])
        contexts: list[tuple[int | None, int | None]] = [(own, None if own is None else psi[own])]
        if own is not None:
            si = int(op_sweep[t.uses[0]])
            if si < 0:
                raise ValueError(f"layer tensor {t.name!r} is first used at op {t.uses[0]}, outside every sweep")
            if own == sweeps[si].first_layer(L):
                contexts += [(own, j) for j in inserted]
        broadcast = _broadcast_offsets(t, op_sweep, op_layer, sweeps, L) if own is None else {}
        for src, dst in contexts:
            def move(u: int) -> int:
                if op_sweep[u] < 0:
                    return int(outside_new[u])
                if src is None:
                    return in_layer(u, psi[int(op_layer[u])])
                return in_layer(u, dst + int(op_layer[u]) - src)

            uses = [move(u) for u in t.uses]
            for si, offsets in broadcast.items():
                uses += [in_layer(sweeps[si].start + o, j) for j in inserted for o in offsets]
            uses = sorted(set(uses))
            m = _INTERMEDIATE.match(t.name)
            if m:
                name = f"op{move(int(m.group(1)))}:out{m.group(2)}"
            elif src is not None and t.persistent:
                name = _LAYER.sub(lambda g: f"{g.group(1)}:layers.{dst}.", t.name)
            else:
                name = t.name
            order = (0, t.tid, dst or 0) if t.persistent else (1, uses[0], t.tid, dst or 0)
            rows.append((order, TensorRecord(tid=0, name=name, nbytes=t.nbytes, kind=t.kind,
                                             persistent=t.persistent, uses=uses)))
    rows.sort(key=lambda r: r[0])
    tensors = [dataclasses.replace(r, tid=i) for i, (_, r) in enumerate(rows)]
    meta = dict(trace.meta)
    meta.pop("optimizer_ops", None)  # op indices of the profile, not of this trace
    if "n_layers" in meta:
        meta["n_layers"] = Lp
    meta["synthesized"] = {"n_layers_profiled": L, "n_layers": Lp,
                           "sweeps": [dataclasses.asdict(s) for s in sweeps]}
    return Trace(op_names=names, op_seconds=np.concatenate(seconds), tensors=tensors, meta=meta)


def _broadcast_offsets(t: TensorRecord, op_sweep: np.ndarray, op_layer: np.ndarray,
                       sweeps: list[Sweep], L: int) -> dict[int, list[int]]:
    """For a tensor made outside the blocks: sweep -> block offsets, if every layer of
    that sweep uses it at the same offsets (a table every layer reads); else {}."""
    per: dict[int, dict[int, set[int]]] = {}
    for u in t.uses:
        si = int(op_sweep[u])
        if si >= 0:
            sw = sweeps[si]
            per.setdefault(si, {}).setdefault(int(op_layer[u]), set()).add((u - sw.start) % sw.period)
    out = {}
    for si, layers in per.items():
        sets = list(layers.values())
        if len(layers) != L or any(s != sets[0] for s in sets):
            return {}
        out[si] = sorted(sets[0])
    return out


def layered_trace(n_layers: int, sublayers: int = 4, weight_bytes: int = 64 << 20,
                  act_bytes: int = 32 << 20, mm_seconds: float = 1e-3) -> Trace:
    """A toy training-step trace of an ``n_layers``-deep residual MLP, named like the
    profiler's traces: forward, backward, then a per-parameter Adam step.

    Each layer has ``sublayers`` weights of ``weight_bytes`` bytes (plus two optimizer
    states and a gradient of the same size); each sublayer's forward is ``mm``,
    in-place ``relu_``, residual ``add``, saving ``act_bytes``-byte activations for
    backward. Matmuls take ``mm_seconds`` s, elementwise ops a tenth, optimizer ops a
    twentieth. About ``12 * sublayers`` ops and ``8 * sublayers`` tensors per layer.
    For planner benchmarks and for testing :func:`synthesize_layers` without a profile.
    """
    if n_layers < 1 or sublayers < 1:
        raise ValueError(f"n_layers={n_layers}, sublayers={sublayers}; both must be >= 1")
    names: list[str] = []
    seconds: list[float] = []
    recs: list[dict] = []

    def tensor(name: str, nbytes: int, kind: str, persistent: bool = False) -> int:
        recs.append(dict(name=name, nbytes=nbytes, kind=kind, persistent=persistent, uses=[]))
        return len(recs) - 1

    def op(name: str, secs: float, uses: list[int], out: tuple[int, str] | None = None) -> int:
        """Record op k touching ``uses``; ``out=(nbytes, kind)`` allocates its output."""
        k = len(names)
        names.append(name)
        seconds.append(secs)
        for t in uses:
            recs[t]["uses"].append(k)
        if out is None:
            return -1
        t = tensor(f"op{k}:out0", out[0], out[1])
        recs[t]["uses"].append(k)
        return t

    ew, opt = mm_seconds / 10, mm_seconds / 20
    fqns = (["tok_embeddings.weight"] + [f"layers.{l}.w{i}.weight" for l in range(n_layers)
                                         for i in range(sublayers)] + ["output.weight"])
    param = {f: tensor(f"param:{f}", weight_bytes, "param", True) for f in fqns}
    state = {(f, s): tensor(f"optim:{f}:{s}", weight_bytes, "optim", True)
             for f in fqns for s in ("exp_avg", "exp_avg_sq")}
    tokens = tensor("input:tokens", 8 << 10, "input")

    x = op("aten.embedding.default", ew, [param["tok_embeddings.weight"], tokens], (act_bytes, "activation"))
    saved = {}
    for l in range(n_layers):
        for i in range(sublayers):
            w = param[f"layers.{l}.w{i}.weight"]
            y = op("aten.mm.default", mm_seconds, [w, x], (act_bytes, "activation"))
            op("aten.relu_.default", ew, [y])
            saved[l, i] = (x, y)
            x = op("aten.add.Tensor", ew, [y, x], (act_bytes, "activation"))
    logits = op("aten.mm.default", mm_seconds, [x, param["output.weight"]], (4 * act_bytes, "activation"))
    loss = op("aten._log_softmax.default", ew, [logits], (4 << 10, "activation"))
    glog = op("aten._log_softmax_backward_data.default", ew, [loss, logits], (4 * act_bytes, "temp"))
    grads = {"output.weight": op("aten.mm.default", mm_seconds, [glog, x], (weight_bytes, "grad"))}
    g = op("aten.mm.default", mm_seconds, [glog, param["output.weight"]], (act_bytes, "temp"))
    for l in reversed(range(n_layers)):
        for i in reversed(range(sublayers)):
            xin, y = saved[l, i]
            f = f"layers.{l}.w{i}.weight"
            gy = op("aten.threshold_backward.default", ew, [g, y], (act_bytes, "temp"))
            grads[f] = op("aten.mm.default", mm_seconds, [gy, xin], (weight_bytes, "grad"))
            gx = op("aten.mm.default", mm_seconds, [gy, param[f]], (act_bytes, "temp"))
            op("aten.add_.Tensor", ew, [gx, g])
            g = gx
    grads["tok_embeddings.weight"] = op("aten.embedding_dense_backward.default", ew, [g, tokens],
                                        (weight_bytes, "grad"))
    for f in fqns:
        m, v, p, gr = state[f, "exp_avg"], state[f, "exp_avg_sq"], param[f], grads[f]
        op("aten.mul_.Tensor", opt, [p])
        op("aten.lerp_.Scalar", opt, [m, gr])
        op("aten.mul_.Scalar", opt, [v])
        op("aten.addcmul_.Tensor", opt, [v, gr])
        op("aten.addcdiv_.Tensor", opt, [p, m, v])
    tensors = [TensorRecord(tid=i, **r) for i, r in enumerate(recs)]
    return Trace(op_names=names, op_seconds=np.asarray(seconds), tensors=tensors,
                 meta={"model": f"toy-{n_layers}x{sublayers}", "n_layers": n_layers})
