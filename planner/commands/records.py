"""Records: the `ledger` of measured and estimated lines (show, export), and the GPU `catalog` (list, show, validate,
import)."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pandas as pd

from planner.commands.common import catalog_path_option, format_option, friendly_errors, ledger_option, progress
from planner.errors import InputError
from planner.inputs.catalog import default_catalog_path, load_catalog, merged_catalog_text, parse_catalog
from planner.inputs.sources import SOURCES
from planner.inputs.yamlsafe import MAX_CATALOG_BYTES, load_yaml_file, load_yaml_text
from planner.ledger import export_frame, read_lines
from planner.outputs.tables import lines_view, render
from planner.storage import atomic_write

# ---------------------------------------------------------------- ledger

@click.group()
def ledger():
    """Show or export the ledger's lines (works without torch)."""


@ledger.command("show")
@ledger_option
@click.option("--run", "run_id", default=None, help="only this run id")
@click.option("--verdict", default=None, help="only lines with this verdict")
@click.option("--workload", default=None, help="only lines of this workload (as the ledger names it: script:NAME, "
                                               "file.py:fn, hf:PATH, ...)")
@format_option
@friendly_errors
def ledger_show(ledger_path, run_id, verdict, workload, fmt):
    """Print the ledger's lines, oldest first.

    Example: rentplan ledger show --ledger rentplan.db --workload script:train --verdict oom"""
    df = read_lines(ledger_path)
    if workload:
        names = sorted(set(df["workload"]))
        df = df[df["workload"] == workload]
        if df.empty:
            raise InputError(f"no lines of workload {workload} in {ledger_path}. It holds: "
                             f"{', '.join(names[:12]) or 'no lines'}{' ...' if len(names) > 12 else ''}.")
    if run_id:
        df = df[df["run_id"] == run_id]
    if verdict:
        df = df[df["verdict"] == verdict]
    click.echo(render(lines_view(df, fmt, workload=True), fmt))


@ledger.command("export")
@ledger_option
@click.option("--to", "dest", required=True, type=click.Path(dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(["csv", "jsonl"]), default=None,
              help="default: from the file's extension")
@friendly_errors
def ledger_export(ledger_path, dest, fmt):
    """Write every line to CSV or JSONL (raw units: bytes, seconds).

    Example: rentplan ledger export --ledger rentplan.db --to lines.csv"""
    fmt = fmt or ("jsonl" if dest.endswith((".jsonl", ".json")) else "csv")
    df = read_lines(ledger_path).drop(columns=["seq"], errors="ignore")
    export_frame(df, Path(dest), fmt)
    progress(f"wrote {len(df)} lines to {dest}")


# ---------------------------------------------------------------- catalog

@click.group()
def catalog():
    """List, show, validate and import GPU catalogs."""


@catalog.command("list")
@catalog_path_option
@format_option
@friendly_errors
def catalog_list(catalog_path, fmt):
    """One row per GPU: memory, speed, features, cheapest offer.

    Example: rentplan catalog list --format markdown"""
    cat = load_catalog(catalog_path)
    offers = cat.offers_frame()
    rows = []
    for g in cat.gpus.values():
        mine = offers[offers["gpu"] == g.id] if len(offers) else offers
        cheapest = mine.loc[mine["price_per_gpu_hour_usd"].idxmin()] if len(mine) else None
        rows.append({
            "gpu": g.id, "name": g.name, "usable GiB": round(g.usable_bytes / 2**30, 2),
            "bf16 TFLOPS": g.bf16_dense_tflops, "TB/s": g.mem_bandwidth_tbps, "cc": g.compute_capability,
            "bf16": g.bf16_supported, "fp8": g.fp8_supported, "offers": len(mine),
            "from $/GPU-h": None if cheapest is None else round(float(cheapest["price_per_gpu_hour_usd"]), 3),
            "cheapest at": None if cheapest is None else cheapest["provider"],
            "unverified": len(g.unverified),
        })
    click.echo(render(pd.DataFrame(rows), fmt))


@catalog.command("show")
@click.argument("gpu_id")
@catalog_path_option
@format_option
@friendly_errors
def catalog_show(gpu_id, catalog_path, fmt):
    """One GPU's specs, sources and every offer.

    Example: rentplan catalog show h100_sxm"""
    from dataclasses import asdict

    cat = load_catalog(catalog_path)
    g = cat.gpu(gpu_id)
    offers = cat.offers_frame()
    offers = offers[offers["gpu"] == g.id].drop(columns=["gpu", "unverified"])
    if fmt == "json":
        click.echo(json.dumps({"gpu": asdict(g), "offers": json.loads(render(offers, "json"))}, indent=2))
        return
    spec = pd.DataFrame([{"field": k, "value": v} for k, v in asdict(g).items()])
    click.echo(render(spec, fmt))
    click.echo("")
    click.echo(render(offers, fmt))


@catalog.command("validate")
@click.argument("path", required=False, type=click.Path(dir_okay=False))
@friendly_errors
def catalog_validate(path):
    """Check a catalog file; every problem is listed at once.

    Example: rentplan catalog validate my-catalog.yaml"""
    cat = load_catalog(path)
    click.echo(f"OK: {cat.source}: {len(cat.gpus)} GPUs, {len(cat.offers)} offers.")


@catalog.command("import")
@click.argument("path", required=False, type=click.Path(exists=True, dir_okay=False))
@click.option("--from", "source", type=click.Choice(list(SOURCES)), default=None,
              help="the catalog source PATH comes from: " + "; ".join(f"{n}: {m.FILE}" for n, m in SOURCES.items()))
@click.option("--skypilot", "skypilot_csv", default=None, type=click.Path(exists=True, dir_okay=False),
              help="a SkyPilot catalog vms.csv (the same as --from skypilot PATH)")
@click.option("--provider", required=True, help="provider name for the imported offers, e.g. lambda")
@click.option("--as-of", "as_of", required=True, help="date of the file's snapshot (YYYY-MM-DD)")
@catalog_path_option
@click.option("--out", "out_path", default=None, type=click.Path(dir_okay=False),
              help="write the merged catalog here (default: print the new offers as YAML)")
@friendly_errors
def catalog_import(path, source, skypilot_csv, provider, as_of, catalog_path, out_path):
    """Import offers from a catalog source's file (prices per instance; GPU memory from this catalog).

    Example: rentplan catalog import --from skypilot vms.csv --provider lambda --as-of 2026-12-01 --out catalog.yaml"""
    if skypilot_csv:
        if path or source not in (None, "skypilot"):
            raise click.UsageError("--skypilot FILE is --from skypilot FILE: give one file and one source.")
        source, path = "skypilot", skypilot_csv
    if not source or not path:
        raise click.UsageError("give the source and its file, e.g. --from skypilot vms.csv.")
    import yaml

    def cat_data(path):
        return load_yaml_file(path, "catalog", MAX_CATALOG_BYTES)

    import datetime as dt

    try:
        dt.date.fromisoformat(as_of)
    except ValueError:
        raise InputError(f"--as-of {as_of!r} must be the snapshot's date as YYYY-MM-DD.") from None
    cat = load_catalog(catalog_path)
    offers, skipped = SOURCES[source].read(path, cat, provider, as_of)
    for s in skipped:
        progress(f"skipped {s}")
    progress(f"imported {len(offers)} offers, skipped {len(skipped)} rows")
    if not out_path:
        click.echo(yaml.safe_dump({"offers": offers}, sort_keys=False))
        return
    src = Path(catalog_path) if catalog_path else default_catalog_path()
    if str(out_path).endswith(".json"):  # a large catalog reads 50 × faster as JSON (still YAML: YAML 1.2 holds it)
        data = cat_data(src)
        data["offers"] = list(data.get("offers") or []) + offers
        text, note = json.dumps(data, indent=1, ensure_ascii=False) + "\n", "written as JSON (comments are not kept)"
    else:
        text, note = merged_catalog_text(src.read_text(encoding="utf-8"), offers, str(src))
    if note:
        progress(f"note: {note}")
    # the merged catalog validates first ...
    parse_catalog(load_yaml_text(text, str(out_path), MAX_CATALOG_BYTES), str(out_path))
    try:
        atomic_write(Path(out_path), text)  # ... then replaces the file in one step
    except OSError as e:
        raise InputError(f"cannot write {out_path}: {e.strerror}.") from None
    progress(f"wrote {out_path}")
