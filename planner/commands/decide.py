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
from planner.commands.measure import run_probe
from planner.errors import InputError
from planner.inputs.campaign_spec import load_campaign
from planner.inputs.catalog import load_catalog
from planner.inputs.grid import GridSpec, parse_list, positive_int
from planner.inputs.names import label_problem
from planner.ledger import Ledger
from planner.outputs.tables import for_machines, lines_view, plans_view, render, selection_view
from planner.units import fmt_usd

# ---------------------------------------------------------------- plan

def example_campaign_path(name: str = "lr-comparison.yaml") -> Path:
    return Path(__file__).resolve().parent.parent / "examples" / name


def parse_days(text: str) -> list[int]:
    days = sorted(set(parse_list(text, positive_int, "--days")))  # a window named twice is one window
    if not days:
        raise InputError("--days needs at least one window, e.g. 3,7,30.")
    return days


def plan_and_write(campaign_path, ledger_path, catalog_path, days, headroom, out, offer_id, fmt, all_offers=False):
    from planner.decisions.pipeline import make_plan
    from planner.decisions.select import observed_times
    from planner.outputs.orders import order_for
    from planner.outputs.render import write_outputs

    for option, path in (("--campaign", campaign_path), ("--out", out)):
        why = path is not None and label_problem(str(path))
        if why:  # both reach sky.yaml's file mounts and run lines
            raise InputError(f"{option} {str(path)!r} {why}; name a folder or file without it.")
    campaign = load_campaign(campaign_path)
    catalog = load_catalog(catalog_path)
    memory_fixes = {v.id: k for v in campaign.variants for k in campaign.changed(v) if k != "lr"}
    if memory_fixes:  # said, not hidden: the sheet sizes one configuration
        progress("note: the plan sizes and times every variant at the spec's own micro_batch, checkpointing and "
                 f"precision; {', '.join(f'{v} ({k})' for v, k in memory_fixes.items())} differ, so their hours "
                 "are the control's (probe their settings to see their own)")
    with Ledger(ledger_path, create=False) as led:
        lines, runs, metrics = led.frame(), led.table("campaign_runs"), led.table("campaign_metrics")
    result = make_plan(campaign, lines, catalog, headroom, parse_days(days),
                       observed=observed_times(runs, metrics, campaign), offer_id=offer_id)
    order = order_for(campaign, result, catalog, headroom, offer_id)
    if order is not None and order["expect"]["device_kind"] == "rocm":
        progress(f"note: no sky.yaml for {order['offer']['id']}: rentplan has not sized ROCm GPUs (its need and time "
                 "use CUDA's allocator, kernels and context) and does not launch them; order.json says what was "
                 "planned")
    if out:
        written = write_outputs(Path(out), campaign, result.sheet, result.plans, result.budget, result.lines,
                                catalog, headroom, order, spec_path=str(campaign_path),
                                dearer=result.dearer if all_offers else None, on_note=click.echo)
        progress("wrote " + ", ".join(str(p) for p in written))
    if fmt == "json":
        click.echo(json.dumps({"selection": json.loads(render(result.sheet, "json")),
                               "plans": json.loads(render(result.plans, "json")), "budget": result.budget,
                               "order": order}, indent=2, default=str))
        return result
    click.echo(render(selection_view(result.sheet, fmt), fmt))
    if not for_machines(fmt):  # json was written whole above
        click.echo("")
        click.echo(render(plans_view(result.plans, fmt), fmt))
        click.echo("\n" + decision_text(result.sheet))
        from planner.decisions.plans import window_notes

        for note in window_notes(result.plans, result.sheet):
            click.echo(note)
    return result


def decision_text(sheet) -> str:
    """What stdout says was decided: the same decision as the sheet, order.json and sky.yaml."""
    from planner.decisions.pipeline import ordered, recommend

    def describe(r):
        return (f"{r['offer']} ({r['gpu']}, {r['strategy_label']}, {r['precision']}, micro-batch {r['micro_batch']} × "
                f"accumulation {r['grad_accum']}); campaign {fmt_usd(r['campaign_cost_usd_low'])}–"
                f"{fmt_usd(r['campaign_cost_usd_high'])}")
    rec, mine = recommend(sheet), ordered(sheet)
    if sheet.attrs.get("order_for_this_machine"):
        head = "Ordered: this machine (--offer local)." + (f" Recommended: {describe(rec)}." if rec is not None else "")
        return head
    if mine is None:
        from planner.decisions.plans import nothing_to_order

        return f"Nothing to order: {nothing_to_order(sheet)}."
    text = f"Recommended and ordered: {describe(mine)}." if rec is not None and rec["offer"] == mine["offer"] else (
        f"Ordered (you chose it with --offer): {describe(mine)}.\n"
        + (f"Recommended: {describe(rec)}." if rec is not None else "rentplan recommends no offer."))
    text += f"\nStrategy: {mine['strategy_why']}."
    if mine["unmodelled"]:
        text += f"\nNot modelled: {mine['unmodelled']}."
    return text


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
    plan_and_write(campaign_path, ledger_path, catalog_path, days, headroom, out, offer_id, fmt, all_offers)


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
    campaign_path = example_campaign_path(DEMO_CAMPAIGN)
    campaign = load_campaign(campaign_path)
    pilot = spec_from_options({**DEMO_PILOT, "device": device})
    pilot.precision = ["bf16" if pilot.device.startswith("cuda") else "fp32"]
    estimate_spec = demo_estimate_spec(campaign)
    progress(f"rentplan demo: 1) a real pilot of {DEMO_PILOT['workload']} on {pilot.device}; 2) estimates of "
             f"'{campaign.name}' ({campaign_path.name}) for sm80+ kernels; 3) its plan and order sheet.")
    results = []
    for spec in (pilot, estimate_spec):
        results.append(run_probe(spec, ledger_path, 900.0, False))
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
    plan_and_write(str(campaign_path), ledger_path, None, "3,7,30", 0.10, out, None, "table")
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
            click.echo(df.attrs["summary"] + ". Data replicas multiply examples per update; model parallelism does not.")
        return
    bp = batch_plan(micro_batch, grad_accum, replicas, examples, seq_len, drop_last)
    rows = [{"quantity": k, "value": v} for k, v in bp.to_dict().items() if v not in (None, "")]
    click.echo(render(pd.DataFrame(rows), fmt))
