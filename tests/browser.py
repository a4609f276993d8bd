"""A real browser for pages people read: headless Chromium measures a page at a width and reports what does not
read (a page wider than the window, text over text in a picture). Tests skip, naming `make browser`, without it."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

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
  document.querySelectorAll('td').forEach(td => {
    const lines = Math.round(td.getBoundingClientRect().height / parseFloat(getComputedStyle(td).lineHeight));
    if (lines > MAX_LINES) out.push('a cell of ' + lines + ' lines: ' + td.textContent.slice(0, 60));
  });
  const pre = document.createElement('pre'); pre.id = 'layout-check';
  pre.textContent = 'CHECKED ' + out.length + '\\n' + out.join('\\n'); document.body.appendChild(pre);
});
</script>"""


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


def layout_problems(page: Path, tmp_path: Path, width: int, max_cell_lines: int = 1000) -> list[str]:
    """What does not read at this width: a copy of the page with the measuring script, loaded in Chromium."""
    copy = tmp_path / f"measured-{width}.html"
    copy.write_text(page.read_text().replace("</body>", CHECK.replace("MAX_LINES", str(max_cell_lines)) + "</body>"))
    dom = subprocess.run(flags(tmp_path, width) + ["--dump-dom", copy.resolve().as_uri()], capture_output=True,
                         text=True, timeout=120).stdout
    found = re.search(r'<pre id="layout-check">CHECKED (\d+)(.*?)</pre>', dom, re.S)
    assert found, "the measuring script did not run"
    return [ln for ln in found.group(2).strip().splitlines() if ln]


def screenshot(page: Path, tmp_path: Path, width: int, dest: Path, height: int = 1200) -> None:
    subprocess.run(flags(tmp_path, width, height) + [f"--screenshot={dest}", page.resolve().as_uri()],
                   capture_output=True, timeout=120)
