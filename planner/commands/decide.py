"""Decisions: `plan` (selection sheet, 3/7/30-day plans, order), `demo` (pilot + plan + order sheet), `verify` (an
order on the machine it was rented for), `batch` (what a micro-batch, accumulation and replicas make)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import pandas as pd

from planner.batching import batch_plan, compare_settings
from planner.commands.common import (
    catalog_path_option,
    format_option,
    friendly_errors,
    ledger_option,
    progress,
    spec_from_options,
)
from planner.errors import InputError
from planner.inputs.campaign_spec import load_campaign
from planner.inputs.grid import GridSpec
from planner.outputs.tables import for_machines, lines_view, plans_view, render, selection_view

# ---------------------------------------------------------------- plan

def example_campaign_path(name: str = "lr-comparison.yaml") -> Path:
    return Path(__file__).resolve().parent.parent / "examples" / name


def show_plan(campaign_path, ledger_path, catalog_path, days, headroom, out, offer_id, fmt, all_offers=False):
    """planner.api's plan, written under `out` when given, and printed in `fmt`."""
    from planner import api

    api.check_names(campaign=campaign_path, out=out)
    made = api.plan(campaign_path, ledger_path, catalog_path, days, headroom, offer_id, say=progress)
    if out:
        progress("wrote " + ", ".join(str(p) for p in made.write(out, all_offers, on_note=click.echo)))
    if fmt == "json":
        click.echo(json.dumps({"selection": json.loads(render(made.sheet, "json")),
                               "plans": json.loads(render(made.plans, "json")), "budget": made.budget,
                               "order": made.order}, indent=2, default=str))
        return
    click.echo(render(selection_view(made.sheet, fmt), fmt))
    if not for_machines(fmt):  # json was written whole above
        click.echo("")
        click.echo(render(plans_view(made.plans, fmt), fmt))
        click.echo("\n" + made.decision)
        for note in made.window_notes:
            click.echo(note)


@click.command()
@click.option("--campaign", "campaign_path", required=True, type=click.Path(dir_okay=False))
@ledger_option
@catalog_path_option
@click.option("--days", default="3,7,30", show_default=True, help="rental windows in days")
@click.option("--headroom", default=0.10, show_default=True, type=float, help="memory kept free, as a fraction")
@click.option("--out", default=None, type=click.Path(file_okay=False),
              help="write selection.csv, plans.csv, order_sheet.md/.html, budget.md, order.json here")
@click.option("--offer", "offer_id", default=None,
              help="offer for order.json (default: the recommended one; 'local' = this machine)")
@click.option("--all-offers", is_flag=True,
              help="also write selection-all.csv: every offer, the dearer ones of each market included (the sheet "
                   "keeps the cheapest per provider, instance type, GPU, count, nodes, region and spot)")
@format_option
@friendly_errors
def plan(campaign_path, ledger_path, catalog_path, days, headroom, out, offer_id, all_offers, fmt):
    """Selection sheet, 3/7/30-day plans, budget review and order sheet from the ledger and the catalog.

    Example: rentplan plan --campaign campaign.yaml --ledger rentplan.db --out rentplan-out"""
    if all_offers and not out:
        raise InputError("--all-offers writes selection-all.csv into the plan's folder: give --out DIR too.")
    show_plan(campaign_path, ledger_path, catalog_path, days, headroom, out, offer_id, fmt, all_offers)


# ---------------------------------------------------------------- demo

# The real pilot that proves the loop on this device: small, fast (fp32 on a CPU, where bf16 is emulated).
DEMO_PILOT = {"workload": "builtin:gpt", "params": ["layers=2", "d_model=128", "heads=4", "vocab=1024"],
              "micro_batch": "1,4", "seq_len": "128", "eval_seq_len": "256"}
DEMO_CAMPAIGN = "gpt-1b-sweep.yaml"


def demo_estimate_spec(campaign) -> GridSpec:
    """The campaign's model, estimated for the catalog's sm80+ kernels at two micro-batches (a line in tokens)."""
    spec = spec_from_options({"workload": campaign.workload, "micro_batch": "1,8", "seq_len": str(campaign.seq_len),
                              "eval_seq_len": str(campaign.eval.seq_len), "precision": campaign.precision,
                              "device": "cpu", "params": [f"{k}={v}" for k, v in campaign.params.items()]})
    spec.mode, spec.targets = "estimated", ["sm80+"]
    return spec


@click.command()
@click.option("--ledger", "ledger_path", default="rentplan.db", show_default=True, type=click.Path(dir_okay=False))
@click.option("--out", default="rentplan-out", show_default=True, type=click.Path(file_okay=False))
@click.option("--device", default="auto", show_default=True)
@friendly_errors
def demo(ledger_path, out, device):
    """A real pilot of the built-in gpt on this device (the loop works: every phase, resume included), then a
    plan for a 1.3 B-parameter learning-rate sweep sized by estimate for each GPU, and its order sheet.

    Example: rentplan demo --out rentplan-out"""
    from probes.api import probe

    campaign_path = example_campaign_path(DEMO_CAMPAIGN)
    campaign = load_campaign(campaign_path)
    pilot = spec_from_options({**DEMO_PILOT, "device": device})
    pilot.precision = ["bf16" if pilot.device.startswith("cuda") else "fp32"]
    estimate_spec = demo_estimate_spec(campaign)
    progress(f"rentplan demo: 1) a real pilot of {DEMO_PILOT['workload']} on {pilot.device}; 2) estimates of "
             f"'{campaign.name}' ({campaign_path.name}) for sm80+ kernels; 3) its plan and order sheet.")
    results = []
    for spec in (pilot, estimate_spec):
        results.append(probe(spec, ledger_path, 900.0, False, say=progress))
        if results[-1].interrupted:
            raise KeyboardInterrupt
    mine, est = (r.frame() for r in results)
    click.echo(f"1) The loop on this device (measured): {len(mine['run_id'].unique())} configuration(s) × "
               f"{mine['phase'].nunique()} phases")
    click.echo(render(lines_view(mine, "table"), "table"))
    if len(mine) and (mine["verdict"] == "ok").all():
        click.echo("every phase ran on this device, resume in a fresh process included (`rentplan overfit` and "
                   "`rentplan resume-check` show that the loop learns and resumes exactly)")
    else:
        bad = mine[mine["verdict"] != "ok"]
        click.echo(f"{len(bad)} phase(s) did not end ok: see `rentplan ledger show --verdict {bad['verdict'].iloc[0]}`")
    click.echo(f"\n2) {campaign.name}: {len(est['run_id'].unique())} estimate(s) × {est['phase'].nunique()} phases, "
               f"the need per phase (fake tensors, no memory touched):")
    click.echo(render(lines_view(est, "table"), "table"))
    click.echo("")
    click.echo("3) The plan:")
    show_plan(str(campaign_path), ledger_path, None, "3,7,30", 0.10, out, None, "table")
    click.echo(f"\nOrder sheet: {Path(out) / 'order_sheet.md'} (and .html); plans: {Path(out) / 'plans.csv'}; "
               f"budget: {Path(out) / 'budget.md'}; order: {Path(out) / 'order.json'}")


# ---------------------------------------------------------------- verify

@click.command()
@click.argument("order_path", type=click.Path(dir_okay=False))
@click.option("--ledger", "ledger_path", default=None, type=click.Path(dir_okay=False),
              help="keep the verification pilot's lines here (default: a temporary ledger)")
@click.option("--skip-pilot", is_flag=True, help="check the stack only")
@friendly_errors
def verify(order_path, ledger_path, skip_pilot):
    """On the rented machine: check GPU, memory, CUDA, torch and packages, then pilot the ordered settings.

    Example: rentplan verify rentplan-out/order.json"""
    from probes.verify import verify_order

    report = verify_order(order_path, ledger_path, run_pilot=not skip_pilot, progress=progress)
    for check in report["checks"]:
        mark = {"pass": "ok  ", "fail": "FAIL", "warn": "warn"}[check["status"]]
        click.echo(f"[{mark}] {check['name']}: {check['detail']}")
    click.echo("")
    if report["adopt"]:
        click.echo("adopt: every check passed.")
    else:
        reasons = "; ".join(c["detail"] for c in report["checks"] if c["status"] == "fail")
        click.echo(f"do not adopt: {reasons}")
        sys.exit(1)


# ---------------------------------------------------------------- batch

@click.command()
@click.option("--micro-batch", required=True, type=click.IntRange(1, 1 << 20))
@click.option("--grad-accum", required=True, type=click.IntRange(1, 1 << 20))
@click.option("--replicas", default=1, show_default=True, type=click.IntRange(1, 1 << 20),
              help="data-parallel ranks (not model-parallel)")
@click.option("--examples", default=None, type=click.IntRange(1, 10**15), help="examples in one pass over the data")
@click.option("--seq-len", default=None, type=click.IntRange(1, 1 << 20))
@click.option("--drop-last", is_flag=True)
@click.option("--compare", default=None, help="another setting, e.g. micro=4,accum=4[,replicas=2]")
@click.option("--hold", type=click.Choice(["updates", "epochs"]), default="updates", show_default=True,
              help="with --compare: what stays fixed")
@click.option("--updates", default=None, type=click.IntRange(1, 10**9),
              help="with --hold updates: the update budget (default: one pass)")
@format_option
@friendly_errors
def batch(micro_batch, grad_accum, replicas, examples, seq_len, drop_last, compare, hold, updates, fmt):
    """Batch arithmetic: examples and tokens per update, updates per pass, the last partial batch.

    Example: rentplan batch --micro-batch 4 --grad-accum 8 --examples 10000 --compare micro=8,accum=4"""
    if compare:
        df = compare_settings(micro_batch, grad_accum, replicas, compare, hold, examples, updates, seq_len, drop_last)
        click.echo(render(df, fmt))
        if not for_machines(fmt):
            click.echo(df.attrs["summary"]
                       + ". Data replicas multiply examples per update; model parallelism does not.")
        return
    bp = batch_plan(micro_batch, grad_accum, replicas, examples, seq_len, drop_last)
    rows = [{"quantity": k, "value": v} for k, v in bp.to_dict().items() if v not in (None, "")]
    click.echo(render(pd.DataFrame(rows), fmt))
