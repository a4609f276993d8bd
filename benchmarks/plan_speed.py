"""Plan time and memory against catalog size, measured side by side in one run: the whole `rentplan plan` command
(interpreter start, catalog parse and validation, planning, every output file) on the bundled catalog's 69 offers,
then on the same offers repeated with other ids, prices and regions up to 20,000 and 60,000 offers, written as
YAML (block style, as `catalog import` writes it) and as JSON (YAML 1.2 holds JSON; rentplan reads it with the
json module).

    .venv/bin/python benchmarks/plan_speed.py [--repeat 3] [--sizes 20000,60000]

Prints, per catalog: seconds (best of --repeat), peak RSS, the selection.csv size, and the ratio to the 69-offer
plan. Targets (issue 28): 20,000 offers within 2 × the 69-offer time; under 1 GiB for 60,000 offers.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.factories import campaign_yaml, standard_ledger  # noqa: E402

REGIONS = ("us-east-1", "us-west-2", "eu-west-1", "ap-south-1", "eu-central-1")


class _NoAliases(yaml.SafeDumper):
    def ignore_aliases(self, data):
        return True


def grown(n: int) -> dict:
    """The bundled catalog with its offers repeated (new ids, prices moved by up to ±30 %, five regions)."""
    cat = yaml.safe_load((ROOT / "catalog.yaml").read_text())
    base, offers = cat["offers"], []
    for i in range(n):
        o = copy.deepcopy(base[i % len(base)])
        o["id"] = f"{o['id']}-r{i}"
        o["price_per_instance_hour_usd"] = round(o["price_per_instance_hour_usd"]
                                                 * (1.0 + 0.3 * (((i * 7919) % 61) / 30.0 - 1.0)), 4)
        o["note"] = f"region {REGIONS[i % len(REGIONS)]}"
        offers.append(o)
    cat["offers"] = offers
    return cat


def run_plan(tmp: Path, catalog: Path, out: str) -> tuple[float, int]:
    """(seconds, peak RSS bytes) of one `rentplan plan` in a fresh interpreter (wait4 gives that child's own peak)."""
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "planner.cli", "plan", "--campaign", "c.yaml", "--ledger", "l.db",
                          "--catalog", str(catalog), "--out", out], cwd=tmp, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    err = p.stderr.read()
    _, status, usage = os.wait4(p.pid, 0)
    seconds = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"plan failed on {catalog.name}:\n{err.decode()[-2000:]}")
    return seconds, usage.ru_maxrss * 1024  # KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sizes", default="20000,60000")
    ap.add_argument("--write", nargs=2, metavar=("N", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.write:  # in a child: this process stays small, and a child's peak RSS starts from its parent's at fork
        n, where = int(args.write[0]), Path(args.write[1])
        cat = grown(n)
        (where / f"c{n}.yaml").write_text(yaml.dump(cat, Dumper=_NoAliases, sort_keys=False))
        (where / f"c{n}.json").write_text(json.dumps(cat, indent=1))
        return
    sizes = [int(x) for x in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        standard_ledger(tmp / "l.db")
        (tmp / "c.yaml").write_text(campaign_yaml())
        catalogs = [("bundled", ROOT / "catalog.yaml")]
        for n in sizes:
            subprocess.run([sys.executable, __file__, "--write", str(n), str(tmp)], check=True)
            catalogs += [(f"{n:,} YAML", tmp / f"c{n}.yaml"), (f"{n:,} JSON", tmp / f"c{n}.json")]
        rows = []
        for rep in range(args.repeat):  # rounds side by side: a load change hits every catalog alike
            for i, (name, path) in enumerate(catalogs):
                s, _ = run_plan(tmp, path, f"out{i}")
                rows.append((rep, name, s))
        best = {name: min(s for _, n, s in rows if n == name) for name, _ in catalogs}
        print(f"{'catalog':<14} {'offers':>7} {'MiB':>6} {'best s':>7} {'× 69':>6} {'peak RSS':>9} "
              f"{'selection.csv':>14}")
        for i, (name, path) in enumerate(catalogs):
            _, rss = run_plan(tmp, path, f"mem{i}")  # one more run alone, for its peak
            sel = (tmp / f"out{i}" / "selection.csv").stat().st_size
            offers = len(yaml.safe_load(path.read_text()).get("offers") or []) if name == "bundled" else \
                int(name.split()[0].replace(",", ""))
            print(f"{name:<14} {offers:>7,} {path.stat().st_size / 2**20:>6.1f} {best[name]:>7.2f} "
                  f"{best[name] / best['bundled']:>6.2f} {rss / 2**20:>7.0f} Mi {sel / 1024:>11.0f} KiB")
        print("targets: 20,000 offers within 2 × the bundled time; under 1 GiB for 60,000")


if __name__ == "__main__":
    main()
