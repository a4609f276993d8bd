"""The HTML order sheet as people see it: inline SVG pictures with captions, loaded in a real browser."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from planner.cli import cli
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
    assert len(figures) == 3  # the decision, memory, max micro-batch; no cost picture when windows cost alike
    for fig in figures:
        assert fig.lstrip().startswith("<svg") and "</svg>" in fig
        caption = re.search(r"<figcaption>(.*?)</figcaption>", fig, re.S).group(1)
        assert "Basis" in caption
    assert "never added" in html and "src=\"http" not in html  # stands alone, works offline
    assert "built-in method" not in html and "built-in method" not in (page.parent / "order_sheet.md").read_text()
    assert re.search(r"time per update</th><td>[\d.]+ ms – [\d.]+ ms", html)


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        pytest.skip("no chromium: install it with `make browser` (Debian's package; .ci/run does this first)")
    return found


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
    assert dom.count("<svg") >= figures >= 2  # the browser parsed every picture (no cost picture: windows alike)
    assert "planned shape" in dom  # the memory picture's first panel, as text in the SVG
    assert re.search(r"<th>unverified catalog fields</th>", dom)
    if os.environ.get("RENTPLAN_SCREENSHOT"):  # keep a copy only where asked (e.g. for the README picture)
        Path(os.environ["RENTPLAN_SCREENSHOT"]).write_bytes(shot.read_bytes())


CHECK = """<script>
window.addEventListener('load', () => {
  const out = [];
  const doc = document.documentElement;
  if (doc.scrollWidth > window.innerWidth + 1) out.push('page wider than the window: ' + doc.scrollWidth);
  document.querySelectorAll('svg').forEach((svg, i) => {
    const boxes = [...svg.querySelectorAll('text')].map(t => [t.textContent.trim(), t.getBoundingClientRect()])
      .filter(([s, r]) => s && r.width > 0);
    for (let a = 0; a < boxes.length; a++) for (let b = a + 1; b < boxes.length; b++) {
      const [sa, ra] = boxes[a], [sb, rb] = boxes[b];
      const dx = Math.min(ra.right, rb.right) - Math.max(ra.left, rb.left);
      const dy = Math.min(ra.bottom, rb.bottom) - Math.max(ra.top, rb.top);
      if (dx > 1 && dy > 1) out.push('picture ' + i + ': "' + sa + '" overlaps "' + sb + '"');
    }
  });
  const pre = document.createElement('pre'); pre.id = 'layout-check';
  pre.textContent = 'CHECKED ' + out.length + '\\n' + out.join('\\n'); document.body.appendChild(pre);
});
</script>"""


@pytest.mark.parametrize("width", [800, 1400])
def test_the_sheet_reads_at_800_and_1400_px_with_no_text_over_text(page, tmp_path, width):
    """A copy of the sheet with a measuring script: the page is no wider than the window, and no two texts of a
    picture overlap (the browser's own boxes). The screenshot is kept beside it (RENTPLAN_SCREENSHOT_DIR)."""
    exe = chromium()
    copy = tmp_path / "sheet.html"
    copy.write_text(page.read_text().replace("</body>", CHECK + "</body>"))
    flags = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={width},1200", "--virtual-time-budget=5000"]
    dom = subprocess.run(flags + ["--dump-dom", copy.resolve().as_uri()], capture_output=True, text=True,
                         timeout=120).stdout
    found = re.search(r'<pre id="layout-check">CHECKED (\d+)(.*?)</pre>', dom, re.S)
    assert found, "the measuring script did not run"
    assert found.group(1) == "0", found.group(2)
    keep = os.environ.get("RENTPLAN_SCREENSHOT_DIR")
    if keep:
        subprocess.run(flags + [f"--screenshot={Path(keep) / f'order-sheet-{width}.png'}", page.resolve().as_uri()],
                       capture_output=True, timeout=120)
