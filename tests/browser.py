"""A real browser for pages people read: headless Chromium measures a page at a width and reports what does not
read (a page wider than the window, text over text in a picture). Tests skip, naming `make browser`, without it."""

import html
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

CHECK = ("""<script>
window.addEventListener('load', () => {
  const out = [];
  const doc = document.documentElement, W = window.innerWidth;
  const say = el => (el.textContent || '').trim().replace(/\\s+/g, ' ').slice(0, 60);
  // a wrapper that scrolls sideways: the one place where something may be wider than its box
  const scrolls = el => ['auto', 'scroll'].includes(getComputedStyle(el).overflowX);
  const wrapper = el => { for (let p = el.parentElement; p; p = p.parentElement) if (scrolls(p)) return p; """
    """return null; };
  if (doc.scrollWidth > W + 1) out.push('page wider than the window: ' + doc.scrollWidth);
  // off the right edge (even where the page hides it): the outermost such element, outside a scrolling wrapper
  document.querySelectorAll('body *').forEach(el => {
    const r = el.getBoundingClientRect(), up = el.parentElement.getBoundingClientRect();
    if (r.width && r.right > W + 1 && up.right <= W + 1 && !wrapper(el))
      out.push('runs off the right edge (to ' + Math.round(r.right) + ' px): <' + el.tagName.toLowerCase() + """
    """'> ' + say(el));
  });
  // a cell whose text does not fit its box is cut or spills over its neighbour
  document.querySelectorAll('td, th').forEach(c => {
    if (c.scrollWidth > c.clientWidth + 1) out.push('a cell cut (' + c.scrollWidth + ' > ' + c.clientWidth + """
    """' px): ' + say(c));
  });
  document.querySelectorAll('body *').forEach(el => {
    if (getComputedStyle(el).textOverflow === 'ellipsis' && el.scrollWidth > el.clientWidth + 1)
      out.push('text hidden behind an ellipsis: ' + say(el));
  });
  // a table that scrolls sideways keeps its first (identifying) column in view; said with the columns in view
  const scrolling = [];
  document.querySelectorAll('body *').forEach(el => {
    if (!scrolls(el) || el.scrollWidth <= el.clientWidth + 1) return;
    const head = [...(el.querySelector('tr') || el).children], right = el.getBoundingClientRect().right;
    scrolling.push('SCROLLS ' + head.filter(c => c.getBoundingClientRect().right <= right + 1).length + ' of '
      + head.length + ' columns in view: ' + say(head[0] || el));
    el.querySelectorAll('tr').forEach(tr => {
      const first = tr.firstElementChild;
      if (first && getComputedStyle(first).position !== 'sticky')
        out.push('a table scrolls sideways but its first column does not stay: ' + say(first));
    });
  });
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
  document.querySelectorAll('td').forEach(td => {
    const lines = Math.round(td.getBoundingClientRect().height / parseFloat(getComputedStyle(td).lineHeight));
    if (lines > MAX_LINES) out.push('a cell of ' + lines + ' lines: ' + td.textContent.slice(0, 60));
  });
  const pre = document.createElement('pre'); pre.id = 'layout-check';
  pre.textContent = 'CHECKED ' + out.length + ' WIDTH ' + doc.scrollWidth + ' HEIGHT ' + doc.scrollHeight + '\\n'
    + scrolling.concat(out).join('\\n');
  document.body.appendChild(pre);
});
</script>""")


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        pytest.skip("no chromium: install it with `make browser` (Debian's package; .ci/run does this first)")
    return found


def flags(tmp_path: Path, width: int, height: int = 1200) -> list[str]:
    return [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={width},{height}",
            "--virtual-time-budget=5000"]


@dataclass
class Reading:
    """A page as Chromium laid it out at one width."""
    problems: list[str]  # what does not read
    width: int  # the page's own scroll width and height, px
    height: int
    scrolling: list[str]  # each table that scrolls sideways: "N of M columns in view: first header"


def measure(page: Path, tmp_path: Path, width: int, max_cell_lines: int = 1000) -> Reading:
    """A copy of the page with the measuring script (CHECK), loaded in Chromium at this width."""
    copy = tmp_path / f"measured-{page.stem}-{width}.html"
    copy.write_text(page.read_text().replace("</body>", CHECK.replace("MAX_LINES", str(max_cell_lines)) + "</body>"))
    dom = subprocess.run(flags(tmp_path, width) + ["--dump-dom", copy.resolve().as_uri()], capture_output=True,
                         text=True, timeout=120).stdout
    found = re.search(r'<pre id="layout-check">CHECKED (\d+) WIDTH (\d+) HEIGHT (\d+)(.*?)</pre>', dom, re.S)
    assert found, "the measuring script did not run"
    said = [html.unescape(ln) for ln in found.group(4).strip().splitlines() if ln]
    return Reading([ln for ln in said if not ln.startswith("SCROLLS ")], int(found.group(2)), int(found.group(3)),
                   [ln.removeprefix("SCROLLS ") for ln in said if ln.startswith("SCROLLS ")])


def layout_problems(page: Path, tmp_path: Path, width: int, max_cell_lines: int = 1000) -> list[str]:
    """What does not read at this width (see measure)."""
    return measure(page, tmp_path, width, max_cell_lines).problems


def screenshot(page: Path, tmp_path: Path, width: int, dest: Path, height: int = 1200) -> None:
    subprocess.run(flags(tmp_path, width, height) + [f"--screenshot={dest}", page.resolve().as_uri()],
                   capture_output=True, timeout=120)


def read_at(page: Path, tmp_path: Path, width: int, name: str, max_cell_lines: int = 1000) -> Reading:
    """The page measured at this width, with a screenshot of all of it kept as tmp_path/name (and copied under
    RENTPLAN_SCREENSHOTS=DIR where set, for a person to look at)."""
    read = measure(page, tmp_path, width, max_cell_lines)
    shot = tmp_path / name
    screenshot(page, tmp_path, width, shot, height=min(read.height, 12000))
    assert shot.is_file() and shot.read_bytes()[:4] == b"\x89PNG"
    keep = os.environ.get("RENTPLAN_SCREENSHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(keep) / name)
    print(f"{name}: window {width} px, page {read.width} × {read.height} px; scrolling tables: {read.scrolling}; "
          f"problems: {read.problems}")
    return read
