"""Checks of a training loop before renting: `inspect` (what the loss sees), `overfit` (it learns), `resume-check`
(it resumes exactly), `split` (train/val/test without leakage)."""

from __future__ import annotations

from pathlib import Path

import click

from planner.commands.common import format_option, friendly_errors, progress, workload_options
from planner.errors import InputError
from planner.inputs.grid import parse_params
from planner.outputs.tables import render
from planner.tools.splits import check_splits, parse_ratios, read_table, split_frame, write_table

# ---------------------------------------------------------------- checks

@click.command()
@workload_options
@click.option("-n", "n", default=3, show_default=True, help="examples to show")
@click.option("--split", default="train", show_default=True)
@click.option("--seq-len", default=32, show_default=True)
@click.option("--strict", is_flag=True, help="exit 1 when there is any warning")
@friendly_errors
def inspect(workload, params, n, split, seq_len, strict):
    """Show what the loss really receives for a few examples, and warn about masking mistakes.

    Example: rentplan inspect -w hf:./my-model -p data=train.jsonl -p fields=prompt,response -n 3"""
    from probes.checks import inspect_workload

    rep = inspect_workload(workload, parse_params(list(params)), n, split, seq_len)
    for i, ex in enumerate(rep.examples):
        click.echo(f"example {i}:")
        for k, v in ex.items():
            click.echo(f"  {k:>10}: {v}")
    share = f" of {rep.positions} positions ({rep.counted / rep.positions:.0%})" if rep.positions else ""
    click.echo(f"\ncounted targets: {rep.counted}{share}")
    click.echo(f"task: {output_text(rep)}")
    if rep.class_names:
        click.echo("classes: " + ", ".join(f"{i}={c}" for i, c in enumerate(rep.class_names)))
    for w in rep.warnings:
        click.echo(f"warning: {w}", err=True)
    if not rep.warnings:
        click.echo("no masking problems found")
    if strict and rep.warnings:
        raise click.ClickException(f"{len(rep.warnings)} warning(s) with --strict")


def output_text(rep) -> str:
    """The model's task and what its output holds: a width only where the last axis is classes or a vocabulary."""
    from probes.checks import TASKS

    if rep.task == "classification" and rep.n_outputs is not None:
        return f"{TASKS[rep.task]}; model outputs: {rep.n_outputs} classes"
    if rep.task == "causal-lm" and rep.n_outputs is not None:
        return f"{TASKS[rep.task]}; model outputs: {rep.n_outputs} (vocabulary)"
    shape = "×".join(map(str, rep.output_shape)) if rep.output_shape else "not seen (no tensor output)"
    return f"{TASKS[rep.task]}; model output per example: {shape}"


@click.command()
@workload_options
@click.option("--examples", default=8, show_default=True)
@click.option("--updates", default=100, show_default=True)
@click.option("--lr", default=3e-3, show_default=True)
@click.option("--seq-len", default=32, show_default=True)
@click.option("--max-ratio", default=0.10, show_default=True, help="final loss must be <= this × the first")
@friendly_errors
def overfit(workload, params, examples, updates, lr, seq_len, max_ratio):
    """Train on a fixed tiny subset: the loop must drive the loss down and recover every target.
    This checks the mechanism, not generalisation.

    Example: rentplan overfit -w builtin:gpt --examples 8 --updates 100"""
    from probes.checks import overfit as run_overfit
    from probes.checks import sparkline

    rep = run_overfit(workload, parse_params(list(params)), examples, updates, lr, seq_len, max_ratio)
    if rep.losses:
        click.echo(f"loss {rep.losses[0]:.4g} → {rep.losses[-1]:.4g} over {len(rep.losses)} updates  "
                   f"{sparkline(rep.losses)}")
    if rep.recovered:
        click.echo(f"predict() recovered {rep.recovered[0]} of {rep.recovered[1]} target ids")
    click.echo("(a mechanism check on a tiny fixed subset: it says nothing about generalisation)")
    if not rep.passed:
        raise click.ClickException("overfit failed: " + "; ".join(rep.failures))
    click.echo("overfit passed")


@click.command("resume-check")
@workload_options
@click.option("--updates", default=10, show_default=True)
@click.option("--at", "at", default=5, show_default=True, help="save after this update")
@click.option("--at-micro", default=0, show_default=True, help="... and this many micro-batches into the next")
@click.option("--grad-accum", default=1, show_default=True)
@click.option("--micro-batch", default=2, show_default=True)
@click.option("--seq-len", default=32, show_default=True)
@click.option("--precision", default="fp32", show_default=True, type=click.Choice(["fp32", "bf16", "fp16"]))
@friendly_errors
def resume_check(workload, params, updates, at, at_micro, grad_accum, micro_batch, seq_len, precision):
    """Run A uninterrupted; B saves at --at and exits; C resumes in a fresh process. Compare everything.

    Example: rentplan resume-check -w builtin:gpt --at 5 --at-micro 1 --grad-accum 2"""
    from probes.checks import resume_check as run_check

    try:
        rep = run_check(workload, parse_params(list(params)), updates, at, at_micro, grad_accum, micro_batch,
                        seq_len, precision)
    except ValueError as e:
        raise InputError(str(e)) from None
    except RuntimeError as e:
        raise InputError(f"resume-check could not run: {e}") from None
    where = f"update {at}" + (f" + {at_micro} micro-batches" if at_micro else "")
    click.echo(f"resumed at {where}; compared updates {rep.compared_updates}")
    for a, c in zip(rep.losses_a, rep.losses_c):
        click.echo(f"  loss uninterrupted {a!r}  resumed {c!r}  {'equal' if a == c else 'DIFFERENT'}")
    if not rep.passed:
        raise click.ClickException("resume is not exact: " + "; ".join(rep.differences))
    click.echo("resume is exact: step, LR, data position, RNG, optimizer, scaler and losses all equal")


@click.command()
@click.argument("data", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--by", default=None, help="group column: no group may appear in two splits")
@click.option("--time", "time_col", default=None, help="time column: val after train, test after val")
@click.option("--gap", default=None, help="gap between splits, in the time column's units (or 7D, 12h)")
@click.option("--ratios", default="0.8,0.1,0.1", show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--out", default=None, type=click.Path(file_okay=False), help="write train/val/test files here")
@click.option("--check", is_flag=True, help="DATA are existing splits (TRAIN VAL [TEST]): look for leaks")
@format_option
@friendly_errors
def split(data, by, time_col, gap, ratios, seed, out, check, fmt):
    """Leakage-safe splits by group (and time), or --check existing splits for shared groups and duplicates.

    Example: rentplan split data.jsonl --by user_id --out splits/"""
    if check:
        if len(data) not in (2, 3):
            raise InputError("split --check takes TRAIN VAL [TEST].")
        frames = {n: read_table(p) for n, p in zip(("train", "val", "test"), data)}
        res = check_splits(frames, by)
        for leak in res["group_leaks"]:
            click.echo(f"group {leak['group']!r} ({by}) is in {leak['splits']}")
        for d in res["duplicates"]:
            click.echo(f"{d['rows']} identical row(s) in {d['splits']}, e.g. {d['example']}")
        if res["group_leaks"] or res["duplicates"]:
            raise click.ClickException(f"{len(res['group_leaks'])} group(s) in more than one split, "
                                       f"{sum(d['rows'] for d in res['duplicates'])} duplicate row(s) across splits")
        click.echo("no group in two splits and no duplicate rows across splits")
        return
    if len(data) != 1:
        raise InputError("split takes one DATA file (or --check TRAIN VAL [TEST]).")
    src = Path(data[0])
    df = read_table(src)
    res = split_frame(df, by, parse_ratios(ratios), time_col, gap, seed)
    click.echo(render(res.report, fmt))
    for note in res.notes:
        click.echo(f"note: {note}", err=True)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        for name, part in res.parts.items():
            write_table(part, Path(out) / f"{name}{src.suffix}")
        progress(f"wrote {', '.join(f'{n}{src.suffix}' for n in res.parts)} to {out}")
