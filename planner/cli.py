"""rentplan command line. Commands parse options, call one function, render. Torch is imported only
inside the commands that run a pilot, so planning, sheets and ledger commands work without torch.

    rentplan demo                       # pilot + plan + order sheet on built-in defaults
    rentplan probe --micro-batch 1,2,4 --seq-len 256,512 --precision fp32,bf16
    rentplan plan --campaign campaign.yaml --ledger rentplan.db --out rentplan-out
"""

from __future__ import annotations

import functools
import json
import re
import sys
from pathlib import Path

import click
import pandas as pd

from planner import __version__
from planner.errors import InputError, RentplanError
from planner.inputs.grid import (GridSpec, build_grid, checked_count, checked_device, checked_timeout, parse_list,
                                 parse_params, positive_int, resolve_cap, resolve_targets)
from planner.inputs.grid import spec_from_options as parse_spec
from planner.ledger import Ledger, export_frame, read_lines
from planner.records import PHASES
from planner.outputs.tables import FORMATS, lines_view, plans_view, render, selection_view


def resolve_device(device: str) -> str:
    """auto | cpu | cuda | cuda:N: a device this machine lacks is refused before anything runs."""
    device = checked_device(device)
    if device == "cpu":
        return device
    from probes.pilot import available_device  # only the commands that run pilots get here (torch)

    return available_device(device)


def spec_from_options(opts: dict) -> GridSpec:
    """The grid the options and the --grid file describe, on a device this machine has."""
    spec = parse_spec(opts)
    spec.device = resolve_device(spec.device)
    return spec


def progress(msg: str) -> None:
    click.echo(msg, err=True)


def friendly_errors(fn):
    """Expected failures become `Error: ...` and exit 1; Ctrl-C exits 130 with a note."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RentplanError as e:
            raise click.ClickException(str(e)) from None
        except UnicodeDecodeError as e:  # a file read as text that is not UTF-8
            raise click.ClickException(f"a file is not UTF-8 text ({e.reason} at byte {e.start}); save it as "
                                       "UTF-8 and run again.") from None
        except OSError as e:  # unreadable input, unwritable output folder, disk full
            where = f"{e.filename}: " if e.filename else ""
            raise click.ClickException(f"{where}{e.strerror or e}. Check the path and its permissions "
                                       "(nothing was changed)." if not isinstance(e, IsADirectoryError) else
                                       f"{where}is a folder; a file was expected.") from None
        except KeyboardInterrupt:
            click.echo("Interrupted: every line written so far is in the ledger; rerun the same command to "
                       "continue where it stopped.", err=True)
            sys.exit(130)

    return wrapper


def format_option(fn):
    return click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True,
                        help="table/markdown for people, csv/json for machines.")(fn)


def ledger_option(fn):
    return click.option("--ledger", "ledger_path", default="rentplan.db", show_default=True,
                        type=click.Path(dir_okay=False), help="SQLite ledger file.")(fn)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="rentplan")
def cli():
    """rentplan: pilot your training loop, then pick the GPU rental (which, how many, how long, what cost)."""


def main() -> None:
    cli()


# ---------------------------------------------------------------- probe


def grid_options(fn):
    opts = [
        click.option("--workload", "-w", default=None,
                     help="builtin:gpt | builtin:classifier | file.py:fn | module:fn | hf:CONFIG_DIR | script:NAME "
                          "(with --script)"),
        click.option("--param", "-p", "params", multiple=True, help="workload parameter key=value (repeatable)."),
        click.option("--micro-batch", default=None, help="comma list, e.g. 1,2,4"),
        click.option("--seq-len", default=None, help="comma list, e.g. 256,512"),
        click.option("--eval-seq-len", default=None, help="comma list; default: each seq-len"),
        click.option("--eval-micro-batch", default=None, type=int, help="default: the micro-batch"),
        click.option("--precision", default=None, help="comma list of fp32 (32-true), bf16 (bf16-mixed), fp16 (16-mixed), bf16-true, 16-true"),
        click.option("--checkpointing", default=None, help="comma list of off,on"),
        click.option("--optimizer", default=None,
                     help="comma list of adamw (foreach), adamw_fused, sgd, adamw8bit, paged_adamw8bit, adafactor"),
        click.option("--grad-accum", default=None, help="comma list"),
        click.option("--effective-batch", default=None, type=int,
                     help="examples per update; sets grad-accum = N / micro-batch"),
        click.option("--steady-updates", default=None, type=int, help="timed updates after the first (>= 3)"),
        click.option("--lr", default=None, type=float),
        click.option("--cap", default=None, help="cap memory at a catalog GPU's usable memory (GPU id) or a size"),
        click.option("--catalog", "catalog_path", default=None, type=click.Path(dir_okay=False)),
        click.option("--device", default="auto", show_default=True, help="auto | cpu | cuda | cuda:N"),
        click.option("--strategy", default=None, help="single | ddp | fsdp (FSDP2 fully_shard per block)"),
        click.option("--nproc", default=None, type=int, help="ranks on this machine, started by torch's launcher"),
        click.option("--grid", "grid_file", default=None, type=click.Path(dir_okay=False),
                     help="probe YAML file with the same keys as these options"),
        click.option("--lora", default=None, help="hf: workloads: r=16,alpha=32,targets=q_proj+v_proj"),
        click.option("--quantize", default=None, type=click.Choice(["nf4", "fp4", "int8"]),
                     help="hf: workloads with --lora: the base's linears in 4 or 8 bits (QLoRA, bitsandbytes)"),
        click.option("--data", default=None, type=click.Path(),
                     help="hf: workloads: your JSONL (or a split folder); its p99/longest lengths set the lengths"),
        click.option("--fields", default=None, help="hf: workloads: prompt,response | text | text,label"),
        click.option("--val-data", default=None, type=click.Path(dir_okay=False),
                     help="hf: workloads: validation JSONL (else --data may be a folder from `rentplan split`)"),
        click.option("--on-truncate", default=None, type=click.Choice(["warn", "drop", "error"]),
                     help="hf: workloads: examples longer than seq_len are counted and trained on cut (warn), "
                          "left out (drop), or refused (error)"),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def run_probe(spec: GridSpec, ledger_path: str, timeout_s: float, retry_failed: bool):
    """Check the workload here (clear errors before any worker starts), then run the grid."""
    checked_timeout(timeout_s)
    from probes.runner import run_grid, start_workers

    start_workers()  # warms up in parallel with the check below
    from probes.workloads import load_workload

    workload = load_workload(spec.workload, spec.params)
    lengths = getattr(workload, "lengths", None)
    if lengths and not spec.seq_len:  # the data's real lengths, not a guess
        spec.seq_len, spec.eval_seq_len = [lengths["p99"]], spec.eval_seq_len or [lengths["max"]]
        progress(f"data: {lengths['examples']} examples; p99 length {lengths['p99']} tokens drives steady, "
                 f"the longest ({lengths['max']}) drives eval")
    if getattr(workload, "data_note", None):
        progress(f"data: {workload.data_note}")
    if hasattr(workload, "data_report"):
        notes = dict.fromkeys(n for seq_len in sorted(set(spec.seq_len or []))
                              for n in workload.data_report({"train": seq_len}))
        for note in notes:
            progress(f"data: {note}")
    configs = build_grid(spec)
    progress(f"probe: {len(configs)} configuration(s) × {len(PHASES)} phases on {spec.device}; ledger {ledger_path}")
    return run_grid(configs, ledger_path, timeout_s=timeout_s, retry_failed=retry_failed, progress=progress)


@cli.command()
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
    spec = spec_from_options(opts)
    if find:
        return run_find(spec, find, ledger_path, fmt)
    result = run_probe(spec, ledger_path, timeout_s, retry_failed)
    frame = result.frame()
    click.echo(render(lines_view(frame, fmt), fmt))
    if result.interrupted:
        raise KeyboardInterrupt
    setup = frame[frame["phase"] == "setup"] if len(frame) else frame
    if spec.cap and len(setup) and (setup["verdict"] == "oom").all():  # nothing was measured: say what to do
        raise InputError(f"under --cap {spec.cap} not even the model and its optimizer were built (setup ended "
                         f"oom in every configuration; the lines are in {ledger_path}): the cap is below the "
                         "model's own weights. Give a larger GPU or size (`rentplan catalog list`), or size it "
                         "without a cap: `rentplan estimate`.")


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


@cli.command()
@grid_options
@ledger_option
@click.option("--target", "target", default="all", show_default=True,
              help="kernels to estimate with: GPU ids or sm80+ / sm50-75 (CUDA), cpu (this build), all (the catalog's)")
@click.option("--timeout", "timeout_s", default=900.0, show_default=True)
@format_option
@friendly_errors
def estimate(ledger_path, target, timeout_s, fmt, **opts):
    """Size configurations too big for this machine: the same phases under fake tensors (no memory touched),
    with the kernels each target GPU runs (flash / memory-efficient attention, fused dropout, CUDA's autocast
    policy) and a model of CUDA's caching allocator for the reserved peak. Lines are mode=estimated.
    --strategy fsdp --nproc N: rank 0 of N, sharded, on a fake process group (no N devices needed).

    Example: rentplan estimate -p layers=24 -p d_model=2048 --seq-len 2048 --precision bf16 --target a100_80gb"""
    checked_timeout(timeout_s)
    opts["device"] = "cpu"
    spec = spec_from_options(opts)
    spec.mode = "estimated"
    spec.targets = resolve_targets(target, opts.get("catalog_path"))
    result = run_probe(spec, ledger_path, timeout_s, False)
    df = read_lines(ledger_path)
    df = df[df["config_key"].isin({c.key() for c in build_grid(spec)})]
    click.echo(render(lines_view(df, fmt), fmt))
    if fmt in ("table", "markdown"):
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
    what = "micro-batch" if find == "max-micro-batch" else "seq_len"
    if res.best is None:
        first = f" ({what} {res.tried[0][0]} ended {res.tried[0][1]})" if res.tried else ""
        raise InputError(f"not even the smallest {what} ran under the cap {spec.cap}{first}: the cap is below what "
                         "the model needs at its smallest. Give a larger GPU or size (`rentplan catalog list`), or "
                         "size it without a cap: `rentplan estimate`.")
    bracket = (f"; {res.failed_above} failed" if res.failed_above else
               f" ({res.bound}; no failure up to it)" if res.bound else " (no failure up to the search limit)")
    click.echo(f"largest {what} that ran under cap {spec.cap}: {res.best}{bracket}. "
               f"{res.real_probes} real probe(s) after {res.estimate_probes} estimate(s).")


# ---------------------------------------------------------------- ledger

@cli.group()
def ledger():
    """Show or export the ledger's lines (works without torch)."""


@ledger.command("show")
@ledger_option
@click.option("--run", "run_id", default=None, help="only this run id")
@click.option("--verdict", default=None, help="only lines with this verdict")
@format_option
@friendly_errors
def ledger_show(ledger_path, run_id, verdict, fmt):
    """Print the ledger's lines, oldest first.

    Example: rentplan ledger show --ledger rentplan.db --verdict oom"""
    df = read_lines(ledger_path)
    if run_id:
        df = df[df["run_id"] == run_id]
    if verdict:
        df = df[df["verdict"] == verdict]
    click.echo(render(lines_view(df, fmt), fmt))


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

@cli.group()
def catalog():
    """List, show, validate and import GPU catalogs."""


def catalog_path_option(fn):
    return click.option("--catalog", "catalog_path", default=None, type=click.Path(dir_okay=False),
                        help="default: the bundled catalog.yaml")(fn)


@catalog.command("list")
@catalog_path_option
@format_option
@friendly_errors
def catalog_list(catalog_path, fmt):
    """One row per GPU: memory, speed, features, cheapest offer.

    Example: rentplan catalog list --format markdown"""
    from planner.inputs.catalog import load_catalog

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

    from planner.inputs.catalog import load_catalog

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
    from planner.inputs.catalog import load_catalog

    cat = load_catalog(path)
    click.echo(f"OK: {cat.source}: {len(cat.gpus)} GPUs, {len(cat.offers)} offers.")


@catalog.command("import")
@click.option("--skypilot", "csv_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="a SkyPilot catalog vms.csv")
@click.option("--provider", required=True, help="provider name for the imported offers, e.g. lambda")
@click.option("--as-of", "as_of", required=True, help="date of the CSV snapshot (YYYY-MM-DD)")
@catalog_path_option
@click.option("--out", "out_path", default=None, type=click.Path(dir_okay=False),
              help="write the merged catalog here (default: print the new offers as YAML)")
@friendly_errors
def catalog_import(csv_path, provider, as_of, catalog_path, out_path):
    """Import offers from a SkyPilot vms.csv (prices per instance; GPU memory from this catalog).

    Example: rentplan catalog import --skypilot vms.csv --provider lambda --as-of 2026-12-01 --out catalog.yaml"""
    import yaml

    from planner.inputs.catalog import default_catalog_path, import_skypilot, load_catalog, merged_catalog_text

    import datetime as dt

    try:
        dt.date.fromisoformat(as_of)
    except ValueError:
        raise InputError(f"--as-of {as_of!r} must be the snapshot's date as YYYY-MM-DD.") from None
    cat = load_catalog(catalog_path)
    offers, skipped = import_skypilot(csv_path, cat, provider, as_of)
    for s in skipped:
        progress(f"skipped {s}")
    progress(f"imported {len(offers)} offers, skipped {len(skipped)} rows")
    if not out_path:
        click.echo(yaml.safe_dump({"offers": offers}, sort_keys=False))
        return
    src = Path(catalog_path) if catalog_path else default_catalog_path()
    text, note = merged_catalog_text(src.read_text(encoding="utf-8"), offers, str(src))
    if note:
        progress(f"note: {note}")
    from planner.inputs.catalog import parse_catalog
    from planner.outputs.render import atomic_write
    from planner.inputs.yamlsafe import MAX_CATALOG_BYTES, load_yaml_text

    parse_catalog(load_yaml_text(text, str(out_path), MAX_CATALOG_BYTES), str(out_path))  # the merged catalog validates first ...
    try:
        atomic_write(Path(out_path), text)  # ... then replaces the file in one step
    except OSError as e:
        raise InputError(f"cannot write {out_path}: {e.strerror}.") from None
    progress(f"wrote {out_path}")


# ---------------------------------------------------------------- plan

def example_campaign_path(name: str = "lr-comparison.yaml") -> Path:
    return Path(__file__).resolve().parent / "examples" / name


def parse_days(text: str) -> list[int]:
    days = sorted(set(parse_list(text, positive_int, "--days")))  # a window named twice is one window
    if not days:
        raise InputError("--days needs at least one window, e.g. 3,7,30.")
    return days


def plan_and_write(campaign_path, ledger_path, catalog_path, days, headroom, out, offer_id, fmt):
    from planner.inputs.campaign_spec import load_campaign
    from planner.inputs.catalog import load_catalog
    from planner.outputs.orders import order_for
    from planner.decisions.pipeline import make_plan
    from planner.outputs.render import write_outputs

    from planner.decisions.select import observed_times

    from planner.inputs.names import label_problem

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
                                catalog, headroom, order, spec_path=str(campaign_path))
        progress("wrote " + ", ".join(str(p) for p in written))
    if fmt == "json":
        click.echo(json.dumps({"selection": json.loads(render(result.sheet, "json")),
                               "plans": json.loads(render(result.plans, "json")), "budget": result.budget,
                               "order": order}, indent=2, default=str))
        return result
    click.echo(render(selection_view(result.sheet, fmt), fmt))
    if fmt != "csv":
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
    from planner.units import fmt_usd

    def describe(r):
        return (f"{r['offer']} ({r['gpu']}, {r['strategy_label']}, {r['precision']}, micro-batch {r['micro_batch']} × "
                f"accumulation {r['grad_accum']}); campaign {fmt_usd(r['campaign_cost_usd_low'])}–"
                f"{fmt_usd(r['campaign_cost_usd_high'])}")
    rec, mine = recommend(sheet), ordered(sheet)
    if sheet.attrs.get("order_for_this_machine"):
        head = "Ordered: this machine (--offer local)." + (f" Recommended: {describe(rec)}." if rec is not None else "")
        return head
    if mine is None:
        return "Nothing to order: no offer fits."
    text = f"Recommended and ordered: {describe(mine)}." if rec is not None and rec["offer"] == mine["offer"] else (
        f"Ordered (you chose it with --offer): {describe(mine)}.\n"
        + (f"Recommended: {describe(rec)}." if rec is not None else "rentplan recommends no offer."))
    text += f"\nStrategy: {mine['strategy_why']}."
    if mine["unmodelled"]:
        text += f"\nNot modelled: {mine['unmodelled']}."
    return text


@cli.command()
@click.option("--campaign", "campaign_path", required=True, type=click.Path(dir_okay=False))
@ledger_option
@catalog_path_option
@click.option("--days", default="3,7,30", show_default=True, help="rental windows in days")
@click.option("--headroom", default=0.10, show_default=True, type=float, help="memory kept free, as a fraction")
@click.option("--out", default=None, type=click.Path(file_okay=False),
              help="write selection.csv, plans.csv, order_sheet.md/.html, budget.md, order.json here")
@click.option("--offer", "offer_id", default=None,
              help="offer for order.json (default: the recommended one; 'local' = this machine)")
@format_option
@friendly_errors
def plan(campaign_path, ledger_path, catalog_path, days, headroom, out, offer_id, fmt):
    """Selection sheet, 3/7/30-day plans, budget review and order sheet from the ledger and the catalog.

    Example: rentplan plan --campaign campaign.yaml --ledger rentplan.db --out rentplan-out"""
    plan_and_write(campaign_path, ledger_path, catalog_path, days, headroom, out, offer_id, fmt)


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


@cli.command()
@click.option("--ledger", "ledger_path", default="rentplan.db", show_default=True, type=click.Path(dir_okay=False))
@click.option("--out", default="rentplan-out", show_default=True, type=click.Path(file_okay=False))
@click.option("--device", default="auto", show_default=True)
@friendly_errors
def demo(ledger_path, out, device):
    """A real pilot of the built-in gpt on this device (the loop works: every phase, resume included), then a
    plan for a 1.3 B-parameter learning-rate sweep sized by estimate for each GPU, and its order sheet.

    Example: rentplan demo --out rentplan-out"""
    from planner.inputs.campaign_spec import load_campaign

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

@cli.command()
@click.argument("order_path", type=click.Path(exists=True, dir_okay=False))
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

@cli.command()
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
    from planner.tools.batching import batch_plan, compare_settings

    if compare:
        df = compare_settings(micro_batch, grad_accum, replicas, compare, hold, examples, updates, seq_len, drop_last)
        click.echo(render(df, fmt))
        if fmt in ("table", "markdown"):
            click.echo(df.attrs["summary"] + ". Data replicas multiply examples per update; model parallelism does not.")
        return
    bp = batch_plan(micro_batch, grad_accum, replicas, examples, seq_len, drop_last)
    rows = [{"quantity": k, "value": v} for k, v in bp.to_dict().items() if v not in (None, "")]
    click.echo(render(pd.DataFrame(rows), fmt))


# ---------------------------------------------------------------- checks

def workload_options(fn):
    fn = click.option("--param", "-p", "params", multiple=True, help="workload parameter key=value")(fn)
    return click.option("--workload", "-w", default="builtin:gpt", show_default=True,
                        help="builtin:gpt | builtin:classifier | file.py:fn | module:fn | hf:CONFIG_DIR")(fn)


@cli.command()
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
    click.echo(f"\ncounted targets: {rep.counted}{share}; model outputs: {rep.n_outputs}")
    if rep.class_names:
        click.echo("classes: " + ", ".join(f"{i}={c}" for i, c in enumerate(rep.class_names)))
    for w in rep.warnings:
        click.echo(f"warning: {w}", err=True)
    if not rep.warnings:
        click.echo("no masking problems found")
    if strict and rep.warnings:
        raise click.ClickException(f"{len(rep.warnings)} warning(s) with --strict")


@cli.command()
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
    from probes.checks import overfit as run_overfit, sparkline

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


@cli.command("resume-check")
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


@cli.command()
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
    from planner.tools.splits import check_splits, parse_ratios, read_table, split_frame, write_table

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


# ---------------------------------------------------------------- campaign

@cli.group()
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
    outcomes = [o for o in outcomes if o != "skipped"]
    n = len(outcomes)
    counts = {k: outcomes.count(k) for k in ("finished", "diverged", "stopped", "error")}
    summary = (f"{n} run{'s' if n != 1 else ''}: {counts['finished']} finished, {counts['diverged']} diverged, "
               + (f"{counts['stopped']} stopped, " if counts["stopped"] else "")
               + f"{counts['error']} error{'s' if counts['error'] != 1 else ''}"
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
    if fmt in ("table", "markdown"):
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
    from probes.campaign import finish_check
    from probes.runner import call_in_worker

    from planner.tools.archive import campaign_run_row, recorded_sha256_lookup, sha256

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


@cli.command()
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
                         "nothing else is folded into its manifest.")
    files = archive_run(ledger_path, target, Path(dest), Path(out))
    click.echo(f"archived {target} to {dest}: {', '.join(files)}")


@cli.command()
@click.argument("text")
@click.option("--run", "run_id", default=None, help="attach the note to a run")
@ledger_option
@friendly_errors
def note(text, run_id, ledger_path):
    """Record a decision or observation, with the time, in the ledger; reports show it.

    Example: rentplan note "lr 3e-4 diverges past update 400" --run c-1a2b3c4d5e"""
    from datetime import datetime, timezone

    with Ledger(ledger_path) as led:
        led.add("notes", {"run_id": run_id, "text": text, "at": datetime.now(timezone.utc).isoformat(timespec="seconds")})
    click.echo("noted")


if __name__ == "__main__":
    main()
