"""Measuring commands: `probe` runs the pilot of a workload (every phase, real peaks and times) and `estimate` sizes it
under fake tensors for a GPU's kernels; `probe --find` searches the largest micro-batch or sequence under a cap."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pandas as pd

from planner.commands.common import (
    format_option,
    friendly_errors,
    grid_options,
    ledger_option,
    progress,
    spec_from_options,
)
from planner.errors import InputError
from planner.inputs.grid import GridSpec, build_grid, checked_count, checked_timeout, resolve_cap, resolve_targets
from planner.ledger import Ledger, read_lines
from planner.outputs.tables import for_machines, lines_view, render

# ---------------------------------------------------------------- probe


def run_probe(spec: GridSpec, ledger_path: str, timeout_s: float, retry_failed: bool, jobs: int | None = None):
    """probes.api.probe, its progress on stderr."""
    from probes.api import probe as probe_grid

    return probe_grid(spec, ledger_path, timeout_s, retry_failed, jobs, say=progress)


@click.command()
@grid_options
@ledger_option
@click.option("--timeout", "timeout_s", default=900.0, show_default=True, help="seconds per worker before it is killed")
@click.option("--retry-failed", is_flag=True, help="rerun configurations whose earlier run failed (new run ids)")
@click.option("--find", type=click.Choice(["max-micro-batch", "max-seq-len"]), default=None,
              help="search the largest size that fits under --cap (predict, confirm with real probes, bracket)")
@click.option("--script", "script_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="run this plain PyTorch script as it is; its phases come from hooks (args after --)")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@format_option
@friendly_errors
def probe(ledger_path, timeout_s, retry_failed, find, fmt, script_path, script_args, **opts):
    """Run the pilot grid: every configuration through every phase, one ledger line per phase.

    Example: rentplan probe -w builtin:gpt --micro-batch 1,4 --seq-len 128

    Example: rentplan probe --script train.py -w script:train -- --steps 20"""
    checked_timeout(timeout_s)
    if script_path or script_args:
        return probe_script(script_path, list(script_args), ledger_path, timeout_s, fmt, opts)
    if str(opts.get("workload") or "").startswith("script:"):
        raise InputError(f"-w {opts['workload']} names the lines of a plain script: run it with --script FILE, e.g. "
                         f"`rentplan probe --script train.py -w {opts['workload']} -- ARGS`.")
    spec = spec_from_options(opts)
    if find:
        return run_find(spec, find, ledger_path, fmt)
    result = run_probe(spec, ledger_path, timeout_s, retry_failed)
    frame = result.frame()
    click.echo(render(lines_view(frame, fmt), fmt))
    if result.interrupted:
        raise KeyboardInterrupt
    nothing_measured(frame, spec, ledger_path, "size it without a cap: `rentplan estimate`")


def nothing_measured(frame: pd.DataFrame, spec: GridSpec, ledger_path: str, uncapped: str) -> None:
    """Every configuration ended before it measured anything: the lines stay in the ledger (they are verdicts),
    and the command ends with an Error saying what to do, not a table and status 0."""
    setup = frame[frame["phase"] == "setup"] if len(frame) else frame
    if not len(setup):
        return
    if spec.cap and (setup["verdict"] == "oom").all():
        raise InputError(f"under --cap {spec.cap} not even the model and its optimizer were built (setup ended "
                         f"oom in every configuration; the lines are in {ledger_path}): the cap is below the "
                         f"model's own weights. Give a larger GPU or size (`rentplan catalog list`), or {uncapped}.")
    failed = frame[frame["verdict"].isin(["error", "timeout", "killed"])]
    if not (frame["verdict"] == "ok").any() and len(failed):
        first = failed.iloc[0]
        raise InputError(f"every configuration failed before it measured anything: {first['phase']} ended "
                         f"{first['verdict']}: {str(first['detail'])[:300]}. The lines are in {ledger_path}. Check "
                         f"the workload and its -p values with `rentplan inspect -w {spec.workload}`, then run "
                         "the same command again.")


SCRIPT_OPTIONS = {"workload", "steady_updates", "eval_seq_len", "cap", "catalog_path", "device"}


def probe_script(path, argv, ledger_path, timeout_s, fmt, opts) -> None:
    """`probe --script`: the user's script in a worker, lines from hooks (probes/script.py)."""
    if not path:
        raise InputError(f"unexpected argument(s) {' '.join(argv)}: arguments after -- go to a --script.")
    given = {k for k, v in opts.items() if v not in (None, (), "auto")} - SCRIPT_OPTIONS
    if given:
        names = ", ".join("--" + k.replace("_", "-") for k in sorted(given))
        raise InputError(f"{names}: with --script, the script sets these itself; only -w (the workload name), "
                         "--steady-updates, --eval-seq-len and --cap apply.")
    from probes.script import probe_script as run_probe_script

    workload = opts.get("workload") or f"script:{Path(path).stem}"
    if not re.fullmatch(r"script:[A-Za-z0-9._-]+", workload):
        raise InputError(f"-w {workload}: a script's workload name is script:NAME (letters, digits, . _ -); the "
                         "campaign spec names the same workload.")
    cap_label, cap_bytes = resolve_cap(opts.get("cap"), opts.get("catalog_path"))
    steady = checked_count("--steady-updates", opts.get("steady_updates"), 3, 10_000) or 8
    eval_seq = checked_count("--eval-seq-len", opts.get("eval_seq_len"))
    Ledger(ledger_path).close()  # a bad ledger path fails here, before the script runs
    run_id, mine, error = run_probe_script(str(path), argv, str(ledger_path), workload, steady, eval_seq, cap_bytes,
                                           cap_label, timeout_s, progress)
    if len(mine):
        click.echo(render(lines_view(mine, fmt), fmt))
    if error:
        raise InputError(f"the script failed: {error}. Its lines are in {ledger_path} (run {run_id}).")
    if not (mine["phase"] == "eval").any():
        progress("note: the script never called model.eval(), so no eval line: plan needs one (eval on the "
                 "longest sequences) before it uses this run")


@click.command()
@grid_options
@ledger_option
@click.option("--target", "target", default="all", show_default=True,
              help="kernels to estimate with: GPU ids or sm80+ / sm50-75 (CUDA), cpu (this build), all (the catalog's)")
@click.option("--timeout", "timeout_s", default=900.0, show_default=True)
@click.option("--jobs", type=click.IntRange(min=1), default=None,
              help="estimates run side by side, each in its own worker [default: one per usable core]")
@format_option
@friendly_errors
def estimate(ledger_path, target, timeout_s, jobs, fmt, **opts):
    """Size configurations too big for this machine: the same phases under fake tensors (no memory touched),
    with the kernels each target GPU runs (flash / memory-efficient attention, fused dropout, CUDA's autocast
    policy) and a model of CUDA's caching allocator for the reserved peak. Lines are mode=estimated.
    --strategy fsdp --nproc N: rank 0 of N, sharded, on a fake process group (no N devices needed).

    Example: rentplan estimate -p layers=24 -p d_model=2048 --seq-len 2048 --precision bf16 --target a100_80gb"""
    checked_timeout(timeout_s)
    from probes.runner import jobs_limit

    jobs_limit()  # a bad RENTPLAN_JOBS is refused before the ledger is made
    opts["device"] = "cpu"
    spec = spec_from_options(opts)
    spec.mode = "estimated"
    spec.targets = resolve_targets(target, opts.get("catalog_path"))
    result = run_probe(spec, ledger_path, timeout_s, False, jobs)
    df = read_lines(ledger_path)
    df = df[df["config_key"].isin({c.key() for c in build_grid(spec)})]
    click.echo(render(lines_view(df, fmt), fmt))
    if not result.interrupted:
        nothing_measured(result.frame(), spec, ledger_path, "drop --cap to see the need it has")
    if not for_machines(fmt):
        click.echo("estimated: allocated bytes under FakeTensorMode with each target's kernels; reserved simulated "
                   "by a model of CUDA's caching allocator; no times (the planner times from the op census).")
        if spec.nproc > 1:
            click.echo(f"per rank: rank 0 of {spec.nproc} on a fake process group (collectives move nothing, so "
                       "staging buffers a backend may add, and DCP read buffers at resume, are not in the figures).")
    if result.interrupted:
        raise KeyboardInterrupt


def run_find(spec: GridSpec, find: str, ledger_path: str, fmt: str) -> None:
    from probes.search import find_max

    if not spec.cap_bytes:
        raise InputError("--find needs --cap GPU_ID (or a size): it searches what fits under that cap.")
    for name in ("micro_batch", "seq_len"):
        if len(getattr(spec, name) or []) > 1:
            raise InputError(f"--find takes one value for --{name.replace('_', '-')} (the fixed dimension).")
    res = find_max(spec, find, ledger_path, progress=progress)
    rows = pd.DataFrame([{"size": s, "verdict": v} for s, v in res.tried])
    click.echo(render(rows, fmt))
    if res.interrupted:
        raise KeyboardInterrupt  # the sizes measured so far are in the ledger; exit 130 says so
    what = "micro-batch" if find == "max-micro-batch" else "seq_len"
    if res.best is None and res.host_bound:
        raise InputError(f"{res.bound}: this machine cannot hold even the smallest {what} the search would try. "
                         "Run --find on a machine with more memory (or the GPU itself), or size it without "
                         "touching memory: `rentplan estimate`.")
    if res.best is None:
        first = f" ({what} {res.tried[0][0]} ended {res.tried[0][1]})" if res.tried else ""
        raise InputError(f"not even the smallest {what} ran under the cap {spec.cap}{first}: the cap is below what "
                         "the model needs at its smallest. Give a larger GPU or size (`rentplan catalog list`), or "
                         "size it without a cap: `rentplan estimate`.")
    bracket = (f"; {res.failed_above} failed" if res.failed_above else
               f" ({res.bound}; no failure up to it)" if res.bound else " (no failure up to the search limit)")
    beyond = (" A machine with more memory (or the GPU itself) can search past it." if res.host_bound
              and not res.failed_above else "")
    click.echo(f"largest {what} that ran under cap {spec.cap}: {res.best}{bracket}. "
               f"{res.real_probes} real probe(s) after {res.estimate_probes} estimate(s).{beyond}")


for _param in estimate.params:  # estimate runs no script: its -w help leaves script:NAME out
    if _param.name == "workload" and _param.help:
        _param.help = _param.help.replace(" | script:NAME (with --script)", "")
