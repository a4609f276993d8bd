"""Plan time against catalog size, measured side by side in one run: the catalog's own offers, then the same
offers repeated with other prices and ids up to a full SkyPilot-sized catalog (20,000 rows).

    .venv/bin/python benchmarks/plan_speed.py [--offers 20000] [--repeat 3]

Prints seconds per plan (best of --repeat) for each size and their ratio; the target is 20,000 offers in under
twice the time of the built-in catalog's. It times the planner only (catalog already loaded, ledger read).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.inputs.campaign_spec import load_campaign_text  # noqa: E402
from planner.inputs.catalog import load_catalog  # noqa: E402
from planner.ledger import read_lines  # noqa: E402
from planner.decisions.pipeline import make_plan  # noqa: E402
from tests.factories import campaign_yaml, standard_ledger  # noqa: E402


def grown(catalog, n: int):
    """The catalog with its offers repeated (new ids, prices moved by up to ±30 %) until it holds n offers."""
    base = catalog.offers
    offers = []
    for i in range(n):
        o = base[i % len(base)]
        scale = 1.0 + 0.3 * (((i * 7919) % 61) / 30.0 - 1.0)
        offers.append(dataclasses.replace(o, id=f"{o.id}-r{i}", price_per_instance_hour_usd=round(
            o.price_per_instance_hour_usd * scale, 4)))
    return dataclasses.replace(catalog, offers=offers)


def seconds(campaign, lines, catalog, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        make_plan(campaign, lines, catalog, 0.10, [3, 7, 30])
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--offers", type=int, default=20_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        lines = read_lines(standard_ledger(Path(tmp) / "l.db"))
    campaign = load_campaign_text(campaign_yaml(), "benchmark")
    catalog = load_catalog(None)
    small = seconds(campaign, lines, catalog, args.repeat)
    big_catalog = grown(catalog, args.offers)
    big = seconds(campaign, lines, big_catalog, max(1, args.repeat - 1))
    print(f"plan with {len(catalog.offers):>6,} offers: {small:.3f} s")
    print(f"plan with {len(big_catalog.offers):>6,} offers: {big:.3f} s")
    print(f"ratio: {big / small:.2f}x (target: under 2x)")


if __name__ == "__main__":
    main()
