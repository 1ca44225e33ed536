"""Characterization (paper §2.1, Fig. 1–2; claims C19, C20) on a hand-made trace with known
answers, and the command that writes the table and figures."""
import numpy as np
import pytest

from analysis.characterize import characterize, fig1_active, fig2_inactive_cdf, period_seconds, summary_row
from teraio.core.trace import TensorRecord, Trace

MB = 10**6


def hand_trace() -> Trace:
    # Four ops of 10 ms. p (50 MB weight) is used by ops 0 and 1: its one period wraps, from
    # the end of op 1 to the next iteration's op 0, 20 ms. x (20 MB) is idle between ops 0 and
    # 3: 20 ms. z (200 MB) between ops 1 and 3: 10 ms, shorter than its 30.8 ms migration at
    # 6.5 GB/s and not more than 10^4 µs. y (0.5 MB) has no op between its uses: no period.
    tensors = [TensorRecord(0, "param:p", 50 * MB, "param", True, [0, 1]),
               TensorRecord(1, "x", 20 * MB, "activation", False, [0, 3]),
               TensorRecord(2, "y", MB // 2, "activation", False, [1, 2]),
               TensorRecord(3, "z", 200 * MB, "activation", False, [1, 3])]
    return Trace([f"op{k}" for k in range(4)], np.full(4, 0.01), tensors, meta={"model": "hand"})


def test_periods_and_summary_are_exact():
    per = period_seconds(hand_trace()).set_index("tid")["seconds"]
    assert per.to_dict() == pytest.approx({0: 0.02, 1: 0.02, 3: 0.01})
    row = summary_row(hand_trace(), "hand", capacity_bytes=1000 * MB)
    assert row["peak % of capacity"] == pytest.approx(27.05)      # op 1: 50 + 20 + 0.5 + 200 MB
    assert row["active max %"] == pytest.approx(25.05)            # op 1 uses p, y, z
    assert row["active mean %"] == pytest.approx(13.525)          # (70 + 250.5 + 0.5 + 220) / 4 MB
    assert [row[k] for k in ("<1 MB %", "1–10 MB %", "10–100 MB %", "100 MB–1 GB %", ">1 GB %")] == \
        pytest.approx([25, 0, 50, 25, 0])
    assert row["10 MB–1 GB tensors with a period"] == 3
    assert row["of them inactive > 10^4 µs %"] == pytest.approx(200 / 3)          # p and x, not z
    assert row["of them inactive > migration at 6.5 GB/s %"] == pytest.approx(200 / 3)


def test_figures_have_a_line_per_series():
    traces = [("hand", hand_trace()), ("again", hand_trace())]
    ax = fig1_active(traces, 1000 * MB).axes[0]
    assert [ln.get_label() for ln in ax.get_lines()] == ["all", "active"]
    fig = fig2_inactive_cdf(traces)
    assert len(fig.axes) == 2
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["10–100 MB (2)", "100 MB–1 GB (1)"]


def test_command_writes_table_and_figures(tmp_path):
    hand_trace().save(tmp_path / "t.json.gz")
    files = characterize([tmp_path / "t.json.gz"], tmp_path / "out", capacity_bytes=1000 * MB)
    for name in ("characterize.csv", "characterize.md", "characterize.tex", "fig1_active.png",
                 "fig1_active.pdf", "fig2_inactive_cdf.png", "fig2_inactive_cdf.pdf"):
        assert (tmp_path / "out" / name) in files and (tmp_path / "out" / name).stat().st_size > 0
    assert "| hand | 4 | 4 | 27.05 |" in (tmp_path / "out" / "characterize.md").read_text()
    with pytest.raises(ValueError, match="no trace"):
        characterize([], tmp_path / "none")
