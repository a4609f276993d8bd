"""The HTML order sheet as people see it: inline SVG pictures with captions, loaded in a real browser."""

import os
import re
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from planner.cli import cli
from tests.browser import chromium, read_at
from tests.factories import campaign_yaml, standard_ledger

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    d = tmp_path_factory.mktemp("sheet")
    ledger = standard_ledger(d / "l.db")
    camp = d / "c.yaml"
    camp.write_text(campaign_yaml())
    r = CliRunner().invoke(cli, ["plan", "--campaign", str(camp), "--ledger", ledger, "--out", str(d / "out")],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return d / "out" / "order_sheet.html"


def test_every_figure_is_inline_svg_with_a_caption(page):
    html = page.read_text()
    figures = re.findall(r"<figure class=\"chart\">(.*?)</figure>", html, re.S)
    assert len(figures) == 4  # the decision, the plans' timelines, memory, max micro-batch; no cost picture when
    # windows cost alike
    for fig in figures:
        assert fig.lstrip().startswith("<svg") and "</svg>" in fig
        caption = re.search(r"<figcaption>(.*?)</figcaption>", fig, re.S).group(1)
        assert "Basis" in caption
    assert "never added" in html and "src=\"http" not in html  # stands alone, works offline
    assert "built-in method" not in html and "built-in method" not in (page.parent / "order_sheet.md").read_text()
    assert re.search(r"time per update</th><td>[\d.]+ ms – [\d.]+ ms", html)
    # the campaign's 1 h of setup outweighs its training: the decision plots the variants' hours (issue 44)
    assert "against the hours its variants run, without the setup (1.00 h once" in figures[0]


def test_page_loads_in_headless_chromium_with_every_picture(page, tmp_path):
    exe = chromium()
    flags = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0"]
    url = page.resolve().as_uri()
    shot = tmp_path / "sheet.png"
    r = subprocess.run(flags + [f"--screenshot={shot}", "--window-size=1400,3000", url], capture_output=True,
                       text=True, timeout=120)
    assert shot.is_file() and shot.stat().st_size > 20_000, r.stderr[-2000:]
    assert shot.read_bytes()[:4] == b"\x89PNG"
    errors = [ln for ln in r.stderr.splitlines() if "Uncaught" in ln or ("CONSOLE" in ln and "ERROR" in ln)]
    assert not errors
    dom = subprocess.run(flags + ["--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    figures = dom.count("<figcaption>")
    assert dom.count("<svg") >= figures >= 3  # the browser parsed every picture (no cost picture: windows alike)
    assert "planned shape" in dom  # the memory picture's first panel, as text in the SVG
    assert re.search(r"<th>unverified catalog fields</th>", dom)
    if os.environ.get("RENTPLAN_SCREENSHOT"):  # keep a copy only where asked (e.g. for the README picture)
        Path(os.environ["RENTPLAN_SCREENSHOT"]).write_bytes(shot.read_bytes())


@pytest.mark.slow  # Chromium at two widths: make test-slow and CI
@pytest.mark.parametrize("width", [800, 1400])
def test_the_sheet_reads_at_800_and_1400_px_with_nothing_cut(page, tmp_path, width):
    """Issue 44: at 1,400 px the selection's GPU column was cut ("rtx_6000_ad") and "Where the numbers came from"
    ran off the right edge; at 800 px only 4 columns showed. Measured by the page itself in Chromium: nothing wider
    than the window but a table that scrolls sideways with its offer column kept in view, no cell's text cut or
    hidden behind an ellipsis, no two texts of a picture over each other. Screenshots: order-sheet-WIDTH.png."""
    read = read_at(page, tmp_path, width, f"order-sheet-{width}.png")
    assert read.problems == [] and read.width <= width
    if width == 1400:
        assert read.scrolling == []  # every column of every table in view
    else:  # only the selection scrolls, its offer column kept, half its columns in view (4 of 16 before)
        (selection,) = read.scrolling
        shown, total = map(int, re.match(r"(\d+) of (\d+) columns", selection).groups())
        assert selection.endswith(": offer") and shown >= total // 2, selection


def test_the_plans_timeline_shows_each_window_and_what_a_variant_holds(tmp_path):
    """From the user's steps: plan a campaign that saves checkpoints; the sheet draws each window's ★ plan as a
    timeline and its caption gives every part of a variant a nonzero, sourced time (saves and export included)."""
    ledger = standard_ledger(tmp_path / "l.db")
    camp = tmp_path / "c.yaml"
    camp.write_text(campaign_yaml(updates=1_500_000, save_every_updates=100_000))
    r = CliRunner().invoke(cli, ["plan", "--campaign", str(camp), "--ledger", ledger, "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    html = (tmp_path / "o" / "order_sheet.html").read_text()
    (fig,) = [f for f in re.findall(r'<figure class="chart">(.*?)</figure>', html, re.S) if "as timelines" in f]
    for d in (3, 7, 30):
        assert f"{d} days · ★ " in fig
    parts = re.search(r"each variant ([\d.]+) h = training ([\d.]+) h, evaluation ([\d.]+) min, (\d+) checkpoint "
                      r"save\(s\) ([\d.]+) (ms|s), export ([\d.]+) (ms|s)", fig)
    assert parts, fig[-900:]
    assert int(parts.group(4)) == 14 and float(parts.group(5)) > 0 and float(parts.group(7)) > 0
    assert "missing" not in fig


def test_a_plan_without_export_time_says_it_is_missing():
    import pandas as pd

    from planner.outputs.figures import timeline_figure

    sheet = pd.DataFrame([{"offer": "o", "train_hours_high": 2.0, "eval_hours_high": 0.1, "save_hours": 0.0,
                           "export_hours": 0.0, "saves_per_variant": 3, "variant_hours_high": 2.1}])
    plans = pd.DataFrame([{"days": 3, "offer": "o", "variants_in": "a, b", "variants_out": "", "hours_used_high": 5.2,
                           "idle_hours": 66.8, "cheapest_for_priority_1": True}])
    fig, caption = timeline_figure(sheet, plans)
    assert "checkpoint saves: missing" in caption and "export: missing" in caption
