"""What the sheet says matches what it chose (issue 12): stars, search limits, units, pictures' layout."""

import pytest

from planner.decisions.pipeline import make_plan
from planner.inputs.campaign_spec import load_campaign_text
from planner.inputs.catalog import load_catalog
from planner.ledger import read_lines
from planner.outputs.render import sheet_rows
from planner.units import fmt_hours, fmt_usd
from tests.factories import MiB, campaign_yaml, config, pilot_lines, write_ledger


def test_small_durations_and_costs_show_in_units_that_show_them():
    assert fmt_hours(0.0009) == "3.24 s" and fmt_hours(0.25) == "15.0 min" and fmt_hours(3) == "3.00 h"
    assert fmt_usd(0.0034) == "0.34¢" and fmt_usd(0.25) == "25.0¢" and fmt_usd(12.5) == "$12.50"


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
    """A model so small that every GPU holds more than the search limit, planned from two measured points."""
    lines = []
    for mb in (1, 2):
        cfg = config(micro_batch=mb, seq_len=128, eval_seq_len=128, eval_micro_batch=mb)
        lines += pilot_lines(cfg, 10 * MiB + mb * 64 * 1024)
    path = write_ledger(tmp_path_factory.mktemp("tiny") / "l.db", lines)
    camp = load_campaign_text(campaign_yaml(seq_len=128, eval={"every_updates": 50, "examples": 64, "seq_len": 128}),
                              "t")
    return make_plan(camp, read_lines(path), load_catalog(), 0.10)


def test_search_limits_are_never_shown_as_a_gpus_capacity(tiny_plan):
    rows = sheet_rows(tiny_plan.sheet)
    assert all(r["max_mb"].startswith("≥ 4,096 (search limit)") for r in rows)
    assert all("search limit" in r["max_seq"] or r["max_seq"].rstrip("*").isdigit() for r in rows)
    assert not any(r["max_mb"] == "4096" for r in rows)


def test_extrapolated_needs_carry_their_star_in_every_output(tiny_plan, tmp_path):
    from planner.outputs.render import write_outputs

    sheet = tiny_plan.sheet
    assert sheet["need_extrapolated"].any()  # micro-batch 16 from points at 1 and 2
    star = [r for r in sheet_rows(sheet) if r["need"].endswith("*")]
    assert star
    camp = load_campaign_text(campaign_yaml(seq_len=128, eval={"every_updates": 50, "examples": 64, "seq_len": 128}),
                              "t")
    write_outputs(tmp_path, camp, sheet, tiny_plan.plans, tiny_plan.budget, tiny_plan.lines, load_catalog(), 0.10, None)
    need = star[0]["need"]
    for name in ("order_sheet.md", "order_sheet.html"):
        assert need in (tmp_path / name).read_text(), name


def test_the_html_sheet_has_every_row_of_the_markdown_one(tiny_plan, tmp_path):
    import re

    from planner.outputs.render import write_outputs

    camp = load_campaign_text(campaign_yaml(seq_len=128, eval={"every_updates": 50, "examples": 64, "seq_len": 128}),
                              "t")
    write_outputs(tmp_path, camp, tiny_plan.sheet, tiny_plan.plans, tiny_plan.budget, tiny_plan.lines,
                  load_catalog(), 0.10, None)
    md, html = (tmp_path / "order_sheet.md").read_text(), (tmp_path / "order_sheet.html").read_text()
    rent = md.split("## Rent this")[1].split("First command")[0]
    for field in re.findall(r"^\| ([a-z][^|]*?) \|", rent, re.M):
        assert f"<th>{field}</th>" in html, field
    assert "white-space: nowrap" in html


def test_the_markdown_selection_says_the_order_its_rows_are_in(tiny_plan, tmp_path):
    """User: order_sheet.md said 'cheapest first' and left out four cheaper offers (ROCm, FSDP not modelled)
    that the HTML ranks 2nd to 4th: the markdown follows the sheet's rank, and its header says so."""
    import re

    from planner.outputs.render import write_outputs

    camp = load_campaign_text(campaign_yaml(seq_len=128, eval={"every_updates": 50, "examples": 64, "seq_len": 128}),
                              "t")
    write_outputs(tmp_path, camp, tiny_plan.sheet, tiny_plan.plans, tiny_plan.budget, tiny_plan.lines,
                  load_catalog(), 0.10, None)
    md = (tmp_path / "order_sheet.md").read_text()
    header = next(ln for ln in md.splitlines() if ln.startswith("## Selection"))
    assert "fits before tight" in header and "the HTML sheet lists all" in header and \
        not re.search(r"offers fit; cheapest first", header), header
    table = md.split(header)[1].split("\n## ")[0]
    listed = re.findall(r"^\| (\S+-\S+) \|", table, re.M)
    fitting = tiny_plan.sheet[tiny_plan.sheet["verdict"] != "does not fit"]["offer"].tolist()
    assert listed and listed == fitting[:len(listed)]  # the sheet's rank, which the header names


pytest.importorskip("matplotlib")


def _boxes(fig):
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    return renderer


def test_memory_picture_shows_the_planned_shape_first_and_hides_nothing(tiny_plan):
    from planner.outputs.figures import memory_figure

    fig, caption = memory_figure(tiny_plan.lines, tiny_plan.sheet)
    renderer = _boxes(fig)
    axes = fig.axes
    assert axes[0].get_title().startswith("planned shape") and "checkpointing off" in axes[0].get_title()
    legend = fig.legends[0].get_window_extent(renderer)
    for ax in axes:
        assert not legend.overlaps(ax.get_window_extent(renderer))  # the legend sits below, over no bar
    # each candidate GPU is named once, in the legend beside its line's style (labels beside lines overlapped
    # each other and the panel's edge), the ordered one said as such
    names = [t.get_text() for t in fig.legends[0].get_texts() if "fits below" in t.get_text()]
    assert len(names) >= 2 and len(set(names)) == len(names)
    assert sum("(ordered)" in n for n in names) == 1
    assert "planned shape" in caption


def test_no_cost_picture_when_every_window_costs_the_same(tiny_plan):
    from planner.outputs.figures import cost_figure

    assert cost_figure(tiny_plan.plans) is None  # a tiny campaign: every window runs everything once
    plans = tiny_plan.plans.copy()
    plans.loc[plans["days"] == 3, "cost_usd_high"] = plans["cost_usd_high"] / 2
    assert cost_figure(plans) is not None


def test_max_micro_batch_picture_marks_search_limits(tiny_plan):
    from planner.outputs.figures import max_mb_figure

    fig, caption = max_mb_figure(tiny_plan.sheet)
    assert any("search limit" in t.get_text() for t in fig.axes[0].texts)
    assert "search limit" in caption


def test_the_decision_picture_draws_every_window_and_keeps_its_labels_inside_and_apart(tiny_plan):
    """A helper's finding: the 30-day window was not drawn when the offers' hours were short, a point's label
    covered the 3-day window's, and a label was pushed below the plot over the tick labels."""
    from planner.outputs.figures import decision_figure

    fig, _ = decision_figure(tiny_plan.sheet, tiny_plan.plans)
    renderer = _boxes(fig)
    ax = fig.axes[0]
    frame = ax.get_window_extent(renderer)
    windows = [t for t in ax.texts if t.get_text().endswith("-day window")]
    assert sorted(t.get_text() for t in windows) == sorted(f"{d}-day window" for d in tiny_plan.plans["days"].unique())
    low, high = ax.get_ylim()
    assert high >= 24 * tiny_plan.plans["days"].max()
    boxes = [t.get_window_extent(renderer) for t in ax.texts]
    for i, a in enumerate(boxes):
        assert frame.x0 - 1 <= a.x0 and a.x1 <= frame.x1 + 1 and frame.y0 - 1 <= a.y0 and a.y1 <= frame.y1 + 1
        for b in boxes[i + 1:]:
            assert not a.overlaps(b)


def test_the_decision_picture_separates_offers_when_setup_dominates(tiny_plan):
    """Issue 44: a campaign of minutes with 1 h of setup put every offer on the 1 h line, and the recommended
    label covered other points. The picture plots the variants' own hours (the setup said in the caption), so
    offers that differ tenfold in time sit apart, and no label covers a point."""
    from matplotlib.text import Text

    from planner.outputs.figures import decision_figure

    sheet = tiny_plan.sheet
    ok = sheet[sheet["verdict"] != "does not fit"]
    assert (ok["campaign_hours_high"] - 1.0).max() < 0.1  # the setup (1 h) is over 90 % of every offer's hours
    fig, caption = decision_figure(sheet, tiny_plan.plans, setup_hours=1.0)
    renderer = _boxes(fig)
    ax = fig.axes[0]
    points = [ax.transData.transform(xy) for c in ax.containers for xy in c.lines[0].get_xydata()]
    assert len(points) == len(ok)
    ys = sorted(y for _, y in points)
    assert ys[-1] - ys[0] > 0.2 * ax.get_window_extent(renderer).height  # spread over the axis, not on one line
    assert "setup" in caption and "1.00 h" in caption
    labels = [t for t in ax.texts if not t.get_text().endswith("-day window")]
    assert any("recommended" in t.get_text() for t in labels)
    r = 3 * fig.dpi / 72  # a point's marker: 3 pt around its centre
    for t in labels:
        box = Text.get_window_extent(t, renderer)  # the words, without their leader line to the point
        covered = [(x, y) for x, y in points if box.x0 - r < x < box.x1 + r and box.y0 - r < y < box.y1 + r]
        assert not covered, (t.get_text(), covered)


def test_max_micro_batch_bars_end_at_their_micro_batch():
    """Bars started at 0.5 with the value as their width, so the bar of 4 ended near 4.5 on the log axis."""
    import pandas as pd

    from planner.outputs.figures import max_mb_figure

    sheet = pd.DataFrame({"gpu": ["a", "b", "c"], "usable_bytes": [8 * 2**30, 16 * 2**30, 24 * 2**30],
                          "max_micro_batch": [0, 1, 4], "max_micro_batch_extrapolated": [False, False, True],
                          "seq_len": [256] * 3, "need_basis": ["x"] * 3})
    fig, _ = max_mb_figure(sheet)
    bars = [p for p in fig.axes[0].patches if p.get_width() == p.get_width()]  # NaN bars (no fit) drawn as words
    assert sorted(round(b.get_x() + b.get_width(), 6) for b in bars) == [1.0, 4.0]
