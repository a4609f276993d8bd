"""Running the campaign: `campaign run / report / finish`, `archive` (write and verify a run's archive), `note`."""

from __future__ import annotations

from pathlib import Path

import click

from planner.commands.common import format_option, friendly_errors, ledger_option, progress, resolve_device
from planner.errors import InputError
from planner.inputs.grid import parse_list
from planner.ledger import Ledger
from planner.outputs.tables import for_machines, render

# ---------------------------------------------------------------- campaign

@click.group()
def campaign():
    """Run the campaign's variants, report on them, and check the exported artifact."""


@campaign.command("run")
@click.argument("campaign_path", type=click.Path(exists=True, dir_okay=False))
@click.option("--variant", "variant_ids", multiple=True, help="only these variants (repeatable)")
@click.option("--seeds", default=None, help="comma list of seeds per variant (default: each variant's seed, 0)")
@click.option("--lr", "lr_override", default=None, type=float,
              help="retry a variant with another learning rate (a new run id; the old run stays)")
@click.option("--updates", default=None, type=int, help="fewer updates than the spec (a shortened run)")
@ledger_option
@click.option("--out", default="rentplan-runs", show_default=True, type=click.Path(file_okay=False),
              help="the folder each run writes to (its weights, checkpoints, spec and workload as they were)")
@click.option("--device", default="auto", show_default=True)
@click.option("--strategy", type=click.Choice(["ddp", "fsdp"]), default=None,
              help="under torchrun: how the processes share each update (default ddp)")
@friendly_errors
def campaign_run(campaign_path, variant_ids, seeds, lr_override, updates, ledger_path, out, device, strategy):
    """Train each variant (and seed) with everything but the declared variable held to the control's.

    Example: rentplan campaign run lr-comparison.yaml --updates 20

    Example (8 GPUs, every process a share of each update): torchrun --nproc_per_node 8 -m planner.cli campaign
    run lr-comparison.yaml --strategy ddp"""
    import dataclasses as dc

    from planner.inputs.campaign_spec import load_campaign
    from probes.campaign import run_campaign
    from probes.distributed import torchrun_world

    world = torchrun_world()
    if strategy and world == 1:
        raise InputError(f"--strategy {strategy} shares updates between processes: start the campaign with "
                         "torchrun (torchrun --nproc_per_node N -m planner.cli campaign run SPEC --strategy "
                         f"{strategy}).")
    camp = load_campaign(campaign_path)
    chosen = [v for v in camp.variants if not variant_ids or v.id in variant_ids]
    unknown = set(variant_ids) - {v.id for v in camp.variants}
    if unknown:
        raise InputError(f"unknown variant(s) {', '.join(sorted(unknown))}; the spec has "
                         f"{', '.join(v.id for v in camp.variants)}.")
    if lr_override is not None:
        chosen = [dc.replace(v, lr=lr_override) for v in chosen]
    if updates is not None and updates < 1:
        raise InputError(f"--updates must be at least 1, got {updates}.")
    seed_list = parse_list(seeds, int, "--seeds") if seeds else None
    rank = 0
    if world > 1:  # torchrun: each process its own device (cuda:LOCAL_RANK, else cpu with gloo)
        from probes.distributed import init_from_env

        rank, world, torch_device = init_from_env()
        dev, strategy = str(torch_device), strategy or "ddp"
    else:
        dev = resolve_device(device)
    echo = click.echo if rank == 0 else (lambda msg: None)
    outcomes = run_campaign(camp, chosen, seed_list, ledger_path, out, dev, updates, strategy or "single",
                            progress if rank == 0 else (lambda msg: None), echo)
    skipped = outcomes.count("skipped")  # taken by another campaign run of this spec (said above)
    before = outcomes.count("finished before")  # finished with the same settings by an earlier command
    outcomes = [o for o in outcomes if o not in ("skipped", "finished before")]
    n = len(outcomes)
    counts = {k: outcomes.count(k) for k in ("finished", "diverged", "stopped", "error")}
    summary = (f"{n} run{'s' if n != 1 else ''}: {counts['finished']} finished, {counts['diverged']} diverged, "
               + (f"{counts['stopped']} stopped, " if counts["stopped"] else "")
               + f"{counts['error']} error{'s' if counts['error'] != 1 else ''}"
               + (f"; {before} finished before (skipped)" if before else "")
               + (f"; {skipped} left to another campaign run" if skipped else ""))
    echo(summary)
    if counts["error"]:  # a divergence is a result; an error is not
        raise InputError(f"{counts['error']} of {n} runs ended in an error (their events say why: "
                         f"`rentplan campaign report --ledger {ledger_path}`).")


@campaign.command("report")
@click.argument("spec", required=False, type=click.Path(dir_okay=False))
@ledger_option
@click.option("--campaign", "name", default=None, help="campaign name (default: every run in the ledger)")
@click.option("--price", "price_per_hour", default=None, type=float, help="USD per hour of the chosen offer")
@click.option("--out", default=None, type=click.Path(file_okay=False), help="write report.html, curves.svg/png")
@click.option("--predictions", "show_predictions", is_flag=True,
              help="also show the predictions and targets kept at each validation point")
@format_option
@friendly_errors
def campaign_report(spec, ledger_path, name, price_per_hour, out, show_predictions, fmt):
    """One row per variant (changes, status with earlier attempts, budget, quality, validation, time, cost)
    and a conclusion. SPEC (the campaign file, as `campaign run` takes it) or --campaign NAME picks one campaign.

    Example: rentplan campaign report campaign.yaml --ledger rentplan.db --predictions
    """
    from planner.outputs.report import campaign_frames, conclusion, run_table, variant_table, write_campaign_report

    if spec is not None:
        from planner.inputs.campaign_spec import load_campaign

        named = load_campaign(spec).name
        if name is not None and name != named:
            raise InputError(f"{spec} is campaign {named!r}, --campaign says {name!r}: give one of them.")
        name = named

    runs, events, metrics, notes = campaign_frames(ledger_path, name)
    table = run_table(runs, events, metrics)
    variants = variant_table(table, price_per_hour)
    said = conclusion(variants)
    shown = variants.drop(columns=["outcome", "all_finished"])
    click.echo(render(shown, fmt))
    if show_predictions:
        with Ledger(ledger_path, create=False) as led:
            preds = led.table("campaign_predictions")
        preds = preds[preds["run_id"].isin(runs["run_id"])].drop(columns=["seq"])
        preds = preds.merge(runs[["run_id", "variant", "seed"]], on="run_id")
        click.echo("")
        click.echo(render(preds[["variant", "seed", "run_id", "update_no", "item", "prediction", "target"]], fmt)
                   if len(preds) else "no predictions kept (the workload has no predict())")
    if not for_machines(fmt):
        click.echo("")
        click.echo(render(table.drop(columns=["detail", "started_at", "outcome", "control", "quality_target"]), fmt))
        click.echo(f"\nConclusion: {said}")
        for n in notes.itertuples():
            click.echo(f"note {n.at}{f' [{n.run_id}]' if n.run_id else ''}: {n.text}")
    if out:
        written = write_campaign_report(Path(out), runs, table, variants, metrics, notes, said)
        progress("wrote " + ", ".join(str(p) for p in written))


@campaign.command("finish")
@click.argument("run_id")
@ledger_option
@click.option("--out", default="rentplan-runs", show_default=True, type=click.Path(file_okay=False),
              help="the folder `campaign run --out` wrote the runs to (where the run's weights are)")
@friendly_errors
def campaign_finish(run_id, ledger_path, out):
    """Reload the exported artifact in a fresh process and rerun the control inputs recorded at export.

    Example: rentplan campaign finish c-1a2b3c4d5e"""
    from planner.tools.archive import campaign_run_row, recorded_sha256_lookup, sha256
    from probes.campaign import finish_check
    from probes.runner import call_in_worker

    run = campaign_run_row(ledger_path, run_id)
    run_dir = Path(out) / run_id
    if not (run_dir / "model.safetensors").is_file():
        raise InputError(f"no exported model for {run_id} in {run_dir} (did the run finish?).")
    recorded = recorded_sha256_lookup(ledger_path)(run_id)
    now = sha256(run_dir / "model.safetensors")
    if recorded is None:
        raise InputError(f"the ledger has no recorded sha256 for {run_id}'s weights (the run did not finish).")
    if now != recorded:
        raise InputError(f"{run_dir / 'model.safetensors'} has sha256 {now[:16]}…, not the {recorded[:16]}… the run "
                         "recorded when it exported: these are not the weights it exported.")
    try:
        res = call_in_worker(finish_check, (run["config_json"], str(run_dir), int(run["seed"])), 600)
    except RuntimeError as e:
        raise InputError(f"the artifact of {run_id} could not be reloaded: {e}") from None
    if not res["same"]:
        raise click.ClickException("artifact differs from the one exported: " + "; ".join(res["differences"]))
    click.echo(f"{run_id}: the exported artifact reloads in a fresh process and reproduces the control outputs "
               f"(loss {res['loss']!r})")


@click.command()
@click.argument("target")
@click.argument("folder", required=False)
@click.option("--to", "dest", default=None, type=click.Path(file_okay=False), help="archive folder to write")
@ledger_option
@click.option("--out", default="rentplan-runs", show_default=True, type=click.Path(file_okay=False),
              help="the folder `campaign run --out` wrote the runs to (where the run's weights are)")
@friendly_errors
def archive(target, folder, dest, ledger_path, out):
    """`archive RUN --to DIR` writes a verifiable archive; `archive verify DIR` checks one.

    Example: rentplan archive c-1a2b3c4d5e --to archive/

    Example: rentplan archive verify archive/"""
    from planner.tools.archive import archive_run, recorded_sha256_lookup, verify_archive

    if target == "verify":
        if not folder:
            raise InputError("archive verify needs the archive folder.")
        problems, basis = verify_archive(Path(folder), recorded_sha256_lookup(ledger_path))
        if problems:
            raise click.ClickException(f"archive {folder} is not intact: " + "; ".join(problems) + f" ({basis})")
        click.echo(f"archive {folder} is intact: {basis}")
        return
    if not dest:
        raise InputError("archive RUN needs --to DIR.")
    if Path(dest).exists() and (not Path(dest).is_dir() or any(Path(dest).iterdir())):
        raise InputError(f"{dest} is not empty: an archive is written into a new or empty folder, so that "
                         "nothing else is folded into its manifest. Pass --to NEW_FOLDER.")
    from planner.storage import made_or_nothing

    with made_or_nothing(Path(dest)):  # a disk that fills mid-archive leaves no half archive
        files = archive_run(ledger_path, target, Path(dest), Path(out))
    click.echo(f"archived {target} to {dest}: {', '.join(files)}")


@click.command()
@click.argument("text")
@click.option("--run", "run_id", default=None, help="attach the note to a run")
@ledger_option
@friendly_errors
def note(text, run_id, ledger_path):
    """Record a decision or observation, with the time, in the ledger; reports show it.

    Example: rentplan note "lr 3e-4 diverges past update 400" --run c-1a2b3c4d5e"""
    from datetime import datetime, timezone

    with Ledger(ledger_path, create=False) as led:  # a note goes into an existing ledger, on a run it holds
        if run_id is not None and run_id not in set(led.table("campaign_runs")["run_id"]) | set(
                led.frame()["run_id"]):
            raise InputError(f"no run {run_id} in {ledger_path}: `rentplan campaign report` lists campaign runs, "
                             "`rentplan ledger show` the probes' runs.")
    with Ledger(ledger_path) as led:
        led.add("notes", {"run_id": run_id, "text": text,
                          "at": datetime.now(timezone.utc).isoformat(timespec="seconds")})
    click.echo("noted")
