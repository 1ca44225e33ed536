"""Slot sharing in the offload tiers (teraio.core.slots): tensors share a slot only where
no period of one meets a period of another, a tensor keeps one slot for all its periods,
and the cap bounds the bytes of the slots."""
import numpy as np
import pytest

from teraio.core.slots import HostArena, SlotBins


def bins(periods, n_ops=10, cap=None, align=1):
    """SlotBins over ``periods``: [(tid, a, b)], b unrolled."""
    tid, a, b = (np.array(x) for x in zip(*periods))
    return SlotBins(n_ops, tid, a, b, cap, align)


def test_disjoint_periods_share_and_overlapping_ones_do_not():
    sb = bins([(0, 0, 3), (1, 3, 6), (2, 2, 4)])
    assert sb.place(0, 100) == 0
    assert sb.place(1, 100) == 0            # [3, 6) after [0, 3): same slot
    assert sb.place(2, 100) == 2            # [2, 4) meets both: a slot of its own
    assert sb.size == [100, 100] and sb.held_bytes == 200


def test_a_tensor_reserves_all_its_periods_in_its_slot():
    # Tensor 0 is off over [0, 3) and [6, 9); tensor 1's [5, 7) meets the second period only.
    sb = bins([(0, 0, 3), (0, 6, 9), (1, 5, 7), (2, 3, 6)])
    sb.place(0, 64)
    assert sb.place(1, 64) == 1
    assert sb.place(2, 64) == 0             # [3, 6) fits between tensor 0's periods
    assert sb.place(0, 64) == 0             # placed again: its own slot, nothing new
    assert sb.held_bytes == 128


def test_best_fit_and_size():
    sb = bins([(0, 0, 2), (1, 0, 2), (2, 4, 6)])
    sb.place(0, 1000)
    sb.place(1, 300)
    assert sb.place(2, 200) == 1            # the smallest free slot that holds it
    sb2 = bins([(0, 0, 2), (1, 4, 6)])
    sb2.place(0, 100)
    assert sb2.place(1, 101) == 1           # larger than the free slot: a new one


def test_wrapping_periods():
    # n_ops 10: tensor 0 is off from op 8 to op 2 of the next iteration, [8, 12).
    sb = bins([(0, 8, 12), (1, 0, 2), (2, 2, 5)])
    sb.place(0, 8)
    assert sb.place(1, 8) == 1              # [0, 2) lies inside [8, 12) mod 10
    assert sb.place(2, 8) == 0


def test_cap_bounds_the_slots():
    sb = bins([(0, 0, 3), (1, 1, 4), (2, 5, 8)], cap=128, align=64)
    assert sb.room(np.array([0, 1, 2]), np.array([10, 10, 10])).all()
    sb.place(0, 10)
    sb.place(1, 10)                         # overlaps tensor 0: a second 64 B slot
    assert sb.held_bytes == 128
    assert sb.room(np.array([2]), np.array([64])).tolist() == [True]    # shares a free slot
    assert sb.room(np.array([2]), np.array([65])).tolist() == [False]   # too big for one, no room for more
    with pytest.raises(ValueError, match="above the cap of 128 B"):
        sb.place(2, 65)
    with pytest.raises(ValueError, match="tensor 7 has no candidate period"):
        sb.place(7, 1)


def arena(periods, n_ops=10, cap=100):
    """HostArena over ``periods``: [(tid, a, b)], b unrolled."""
    tid, a, b = (np.array(x) for x in zip(*periods))
    return HostArena(n_ops, tid, a, b, cap)


def test_the_host_arena_fits_what_slots_sized_by_their_first_tensor_do_not():
    # Two 50 B tensors over [0, 5), then one of 100 B over [5, 10): bins of 50 + 50 fill the
    # cap and neither takes 100 B; in the region the third goes where both were.
    periods = [(0, 0, 5), (1, 0, 5), (2, 5, 10)]
    sb = bins(periods, cap=100)
    sb.place(0, 50)
    sb.place(1, 50)
    assert not sb.room(np.array([2]), np.array([100]))[0]
    ar = arena(periods)
    assert [ar.place(p, 50) for p in (0, 1)] == [0, 50]
    assert ar.room(np.array([2]), np.array([100]))[0] and ar.place(2, 100) == 0
    assert ar.held_bytes == 100


def test_a_tensor_keeps_its_offset_or_finds_no_room():
    # Tensor 0 is off over [0, 2) and [6, 8); tensor 1 takes offset 0 over [3, 7) after
    # tensor 0's first period, so tensor 0's second period finds its offset taken.
    ar = arena([(0, 0, 2), (1, 3, 7), (0, 6, 8)], cap=80)
    assert ar.place(0, 40) == 0 and ar.place(1, 40) == 0
    assert ar.offset(2, 40) == -1 and not ar.room(np.array([2]), np.array([40]))[0]
    with pytest.raises(ValueError, match="period 2 .* of tensor 0 has no free offset"):
        ar.place(2, 40)


def test_host_arena_ranges_never_meet_over_a_shared_op():
    # Random periods, some wrapping, placed while they fit: any two ranges of different
    # tensors whose periods meet (cyclic) are disjoint, every range lies within the cap,
    # and a tensor's periods share one offset.
    rng = np.random.default_rng(0)
    n, cap = 50, 4096
    periods = []
    for t in range(40):
        a = int(rng.integers(0, n))
        periods += [(t, a, a + int(rng.integers(1, n // 2))), (t, (a + n // 2) % n, (a + n // 2) % n + 3)]
    sizes = {t: int(rng.integers(1, 16)) * 64 for t in range(40)}
    ar = arena(periods, n_ops=n, cap=cap)
    placed = []
    for i, (t, a, b) in enumerate(periods):
        if ar.room(np.array([i]), np.array([sizes[t]]))[0]:
            placed.append((t, a, b, ar.place(i, sizes[t])))
    assert 20 < len(placed) < len(periods)
    ops = lambda a, b: {k % n for k in range(a, b)}
    for i, (t, a, b, off) in enumerate(placed):
        assert 0 <= off and off + sizes[t] <= cap and off == ar.at[t]
        for u, c, d, o in placed[i + 1:]:
            if u != t and ops(a, b) & ops(c, d):
                assert off + sizes[t] <= o or o + sizes[u] <= off


def lowest_free_offset(ar, periods, sizes, placed, period, n, cap):
    """What HostArena.offsets must answer, by brute force over op sets: the tensor's own
    offset if placed and free over the period, else the lowest offset whose bytes meet no
    placed range over a shared op and end within ``cap``; -1 where none is."""
    ops = lambda a, b: {k % n for k in range(a, b)}
    t, a, b = periods[period]
    size = sizes[t]
    taken = [(o, o + sizes[u]) for (u, c, d, o) in placed if ops(a, b) & ops(c, d)]
    free = lambda s: s + size <= cap and all(s + size <= lo or hi <= s for lo, hi in taken)
    if t in ar.at:
        return ar.at[t] if all(ar.at[t] + size <= lo or hi <= ar.at[t] for lo, hi in taken) else -1
    return next((s for s in sorted({0, *(hi for _, hi in taken)}) if free(s)), -1)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("block", [7, 1 << 21])
def test_host_arena_offsets_answer_every_candidate_as_brute_force_does(seed, block, monkeypatch):
    # The planner asks for all candidates at once: each answer (own offset, lowest free
    # offset, or -1) equals a brute-force search over op sets, with the candidates split
    # into blocks or not, at every stage of filling a small region.
    monkeypatch.setattr("teraio.core.slots._BLOCK", block)
    rng = np.random.default_rng(seed)
    n, cap, tensors = 40, 2048, 30
    periods = []
    for t in range(tensors):
        a = int(rng.integers(0, n))
        periods += [(t, a, a + int(rng.integers(1, n))), (t, (a + n // 2) % n, (a + n // 2) % n + 2)]
    sizes = {t: int(rng.integers(1, 12)) * 64 for t in range(tensors)}
    ar = arena(periods, n_ops=n, cap=cap)
    every = np.arange(len(periods))
    nbytes = np.array([sizes[t] for t, _, _ in periods])
    placed, refused = [], 0
    for i in rng.permutation(len(periods)):
        got = ar.offsets(every, nbytes)
        want = [lowest_free_offset(ar, periods, sizes, placed, p, n, cap) for p in every]
        assert got.tolist() == want
        assert ar.room(every, nbytes).tolist() == [w >= 0 for w in want]
        if got[i] >= 0:
            t, a, b = periods[i]
            assert ar.place(int(i), sizes[t]) == got[i]
            placed.append((t, a, b, int(got[i])))
        else:
            refused += 1
    assert refused > 5 and len(placed) > 20
