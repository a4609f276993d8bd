"""Campaign report: one row per variant (seeds as mean and spread, never best-of), a stated conclusion,
and loss curves as SVG/PNG. Reads the ledger's campaign tables; no torch (matplotlib only for pictures)."""

from __future__ import annotations

import io
import json
import math
import re
import statistics
from pathlib import Path

import pandas as pd

from planner import __version__
from planner.errors import InputError, LedgerError
from planner.ledger import Ledger
from planner.outputs.render import render_template
from planner.storage import made_or_nothing, write_all
from planner.units import fmt_usd


def _config(run) -> dict:
    try:
        return json.loads(run.config_json or "{}")
    except (TypeError, ValueError):
        return {}


def _run_status(ev: pd.DataFrame, trained: int) -> tuple[str, str]:
    """(outcome, status text) of one run from its events: a divergence is kept even when the run went on."""
    if ev.empty or set(ev["event"]) == {"started"}:
        return "running or crashed", "running or crashed (no end event)"
    div = ev[ev["event"] == "diverged"]
    last = ev.iloc[-1]
    if len(div):
        at = int(div.iloc[0]["update_no"])
        went_on = trained > at
        return "diverged", f"diverged at update {at}" + (f" (ran on to update {trained})" if went_on else "")
    if last["event"] == "stopped":
        return "stopped", f"stopped at update {int(last['update_no'])} ({last['detail']})"
    return str(last["event"]), str(last["event"])


def run_table(runs: pd.DataFrame, events: pd.DataFrame, metrics: pd.DataFrame) -> pd.DataFrame:
    """One row per run: status from its events, its budget, final/best validation, billed and set-up time."""
    rows: list[dict] = []
    attempts: dict[tuple, int] = {}
    for r in runs.itertuples():
        ev = events[events["run_id"] == r.run_id]
        m = metrics[metrics["run_id"] == r.run_id]
        train, val = m[m["kind"] == "train"], m[m["kind"] == "val"]
        trained = int(train["update_no"].max()) if len(train) else 0
        outcome, status = _run_status(ev, trained)
        cfg = _config(r)
        conf = cfg.get("config", {})
        attempts[(r.variant, r.seed)] = attempts.get((r.variant, r.seed), 0) + 1
        last = ev.iloc[-1] if len(ev) else None
        rows.append({
            "run_id": r.run_id, "variant": r.variant, "seed": r.seed, "lr": r.lr,
            "attempt": attempts[(r.variant, r.seed)], "outcome": outcome, "status": status,
            "detail": "" if last is None else last["detail"],
            "changes": describe_changes(cfg.get("changes") or {}, conf),
            "updates": trained, "planned_updates": int(cfg.get("updates") or trained),
            "effective_batch": (conf["micro_batch"] * conf["grad_accum"]) if "micro_batch" in conf else None,
            "control": cfg.get("control", "control"), "quality_target": cfg.get("quality_target"),
            "final_val_loss": float(val["loss"].iloc[-1]) if len(val) else None,
            "best_val_loss": float(val["loss"].min()) if len(val) else None,
            "final_val_accuracy": float(val["accuracy"].iloc[-1]) if len(val) and pd.notna(val["accuracy"].iloc[-1])
            else None,
            "seconds": float(m[m["kind"] != "setup"]["seconds"].sum()),  # billed: training, evaluation, saves, export
            "setup_s": float(m[m["kind"] == "setup"]["seconds"].sum()),  # building the model: its own figure
            "device": r.device_name, "started_at": r.started_at,
        })
    return pd.DataFrame(rows)


def describe_changes(changes: dict, conf: dict) -> str:
    """What a variant sets differently from the control, in words ('' for the control itself)."""
    words = []
    for key, value in changes.items():
        if key == "micro_batch":
            words.append(f"micro_batch {value} (accumulation {conf.get('grad_accum', '?')})")
        elif key == "checkpointing":
            words.append(f"checkpointing {'on' if value else 'off'}")
        elif key == "lr":
            words.append(f"lr {value:g}")
        else:
            words.append(f"{key} {value}")
    return ", ".join(words)


def _mean(values) -> float | None:
    xs = [x for x in values if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return statistics.mean(xs) if xs else None


def variant_table(runs: pd.DataFrame, price_per_hour: float | None = None) -> pd.DataFrame:
    """One row per variant: the latest attempt per seed counts for quality (seeds as mean ± sample std, never
    best-of); earlier attempts stay visible in the status and on the bill (hours, set-up, cost: every attempt);
    runs of another budget are marked not comparable."""
    ref = _reference_budget(runs)
    rows = []
    for variant, g in runs.groupby("variant", sort=False):
        latest = g.groupby("seed").tail(1)
        finals = [x for x in latest["final_val_loss"] if x is not None and not math.isnan(x)]
        outcomes = sorted(set(latest["outcome"]))
        earlier = g.drop(latest.index)
        status = ", ".join(sorted(set(latest["status"])))
        if len(earlier):
            status += f" on attempt {int(latest['attempt'].max())}; " + "; ".join(
                f"attempt {int(e.attempt)} (lr {e.lr:g}{f', seed {e.seed}' if latest['seed'].nunique() > 1 else ''})"
                f" {e.status}" for e in earlier.itertuples())
        rows.append({
            "variant": variant, "changes": latest["changes"].iloc[-1], "lr": float(latest["lr"].iloc[-1]),
            "seeds": len(latest), "status": status, "outcome": ", ".join(outcomes),
            "updates": int(latest["updates"].max()), "comparable": _comparable(latest, ref),
            "final_val_loss_mean": statistics.mean(finals) if finals else None,
            "final_val_loss_spread": statistics.stdev(finals) if len(finals) > 1 else (0.0 if finals else None),
            "best_val_loss_mean": _mean(latest["best_val_loss"]),
            "final_val_accuracy_mean": _mean(latest["final_val_accuracy"]),
            "all_finished": bool(latest["outcome"].eq("finished").all()),
            # what the variant paid for: every attempt (an interrupted one, the one that resumed it, a retry)
            "hours": g["seconds"].sum() / 3600, "setup_s": float(g["setup_s"].sum()),
            "cost_usd": (g["seconds"].sum() / 3600 * price_per_hour) if price_per_hour else None,
            "attempts": len(g),
        })
    table = pd.DataFrame(rows)
    table.insert(table.columns.get_loc("comparable") + 1, "quality", _quality(table, runs))
    table.attrs["quality_target"] = _target(runs)
    table.attrs["control"] = runs["control"].iloc[-1] if len(runs) else "control"
    return table


def _target(runs: pd.DataFrame) -> dict | None:
    return next((t for t in reversed(list(runs["quality_target"])) if t), None) if len(runs) else None


def _reference_budget(runs: pd.DataFrame) -> tuple[int, int | None] | None:
    """The budget every compared run must share: the control's (its latest attempts), else the commonest."""
    if runs.empty:
        return None
    control = runs["control"].iloc[-1]
    pool = runs[runs["variant"] == control]
    pool = (pool if len(pool) else runs).groupby("seed").tail(1)
    pairs = list(zip(pool["planned_updates"], pool["effective_batch"]))
    return max(set(pairs), key=pairs.count)


def _comparable(latest: pd.DataFrame, ref) -> str:
    if ref is None:
        return "yes"
    updates, eb = ref
    for r in latest.itertuples():
        if r.planned_updates != updates:
            return f"not comparable: {r.planned_updates} of {updates} updates"
        if eb is not None and r.effective_batch is not None and r.effective_batch != eb:
            return f"not comparable: effective batch {r.effective_batch}, the control's {eb}"
    return "yes"


def _quality(table: pd.DataFrame, runs: pd.DataFrame) -> list[str | None]:
    """holds | fails: why | not comparable | no control | control, judged against the control's seed mean."""
    target = _target(runs)
    if not target:
        return [None] * len(table)
    control = runs["control"].iloc[-1]
    metric, worse = target["metric"], float(target["max_worse"])
    column = {"val_loss": "final_val_loss_mean", "val_accuracy": "final_val_accuracy_mean"}[metric]
    ctrl = table[table["variant"] == control]
    base = ctrl[column].iloc[0] if len(ctrl) and ctrl["all_finished"].iloc[0] else None
    out: list[str | None] = []
    for r in table.itertuples():
        value = getattr(r, column)
        if r.variant == control:
            out.append("control")
        elif r.comparable != "yes":
            out.append("not comparable")
        elif not r.all_finished:
            out.append(f"fails: {r.outcome}")
        elif base is None or pd.isna(base):
            out.append("no control (no finished control run to judge against)")
        elif value is None or pd.isna(value):
            out.append(f"not comparable: no {metric}")
        else:
            rel = (value - base) / base if metric == "val_loss" else (base - value) / base
            verdict = "holds" if rel <= worse else (f"fails: {metric} {value:.4g} vs the control's {base:.4g} "
                                                    f"({rel:+.1%} worse, at most {worse * 100:g} % allowed)")
            out.append(verdict)
    return out


def conclusion(variants: pd.DataFrame, control: str | None = None) -> str:
    """A sentence someone can reread: who is best, who diverged, whether the spread allows a call, which runs
    were not comparable, what earlier attempts did, and whether the quality target holds."""
    if variants.empty:
        raise LedgerError("no campaign runs to report; run `rentplan campaign run` first.")
    control = control or variants.attrs.get("control", "control")
    parts = []
    for r in variants.itertuples():
        if r.attempts > 1 and "on attempt" in r.status:
            parts.append(f"{r.variant} {r.status}")
        elif "diverged" in r.outcome:
            parts.append(f"{r.variant} (lr {r.lr:g}) {r.status.split(', ')[0]}")
        if r.comparable != "yes":
            parts.append(f"{r.variant} is {r.comparable} (left out of the comparison)")
    done = variants[variants["all_finished"] & variants["final_val_loss_mean"].notna()
                    & variants["comparable"].eq("yes")]
    judged = variants[variants["quality"].notna() & ~variants["quality"].isin(["control"])]
    if len(judged):
        parts.append(f"quality target ({_target_words(variants)}): " + ", ".join(
            f"{r.variant} {r.quality.split(':')[0]}" for r in judged.itertuples()))
    if done.empty:
        return "; ".join(parts + ["no variant finished"]) + "."
    best = done.sort_values("final_val_loss_mean").iloc[0]
    if control in set(done["variant"]):
        ctrl = done[done["variant"] == control].iloc[0]
        margin = ctrl["final_val_loss_mean"] - best["final_val_loss_mean"]
        noise = max(best["final_val_loss_spread"] or 0.0, ctrl["final_val_loss_spread"] or 0.0)
        if best["variant"] == control:
            parts.insert(0, f"control remains best (final validation loss {ctrl['final_val_loss_mean']:.4g})")
        elif noise and margin <= noise:
            parts.insert(0, f"{best['variant']} is ahead of the control by {margin:.3g}, within the seed spread "
                            f"({noise:.3g}): no clear winner")
        else:
            single = min(best["seeds"], ctrl["seeds"]) < 2
            parts.insert(0, f"{best['variant']} beats the control by {margin:.3g} in final validation loss "
                            f"({best['final_val_loss_mean']:.4g} vs {ctrl['final_val_loss_mean']:.4g})"
                            + (" with one seed: run --seeds 1,2,3 before trusting it" if single else ""))
    else:
        parts.insert(0, f"{best['variant']} has the lowest final validation loss ({best['final_val_loss_mean']:.4g})")
    return "; ".join(parts) + "."


def _target_words(variants: pd.DataFrame) -> str:
    t = variants.attrs.get("quality_target") or {}
    if not t:
        return "against the control"
    word = "worse" if t["metric"] == "val_loss" else "lower"
    return f"{t['metric']} at most {t['max_worse'] * 100:g} % {word} than the control's seed mean"


def curves_figure(runs: pd.DataFrame, metrics: pd.DataFrame, fmt: str = "svg") -> tuple[bytes, list[str]]:
    """Training and validation loss per run on linear axes, one legend for both panels. A diverged run's curve
    ends where it stopped; losses far above every run's first loss (a divergence) are clipped to the top of the
    axis and said in words, so the runs that learn stay readable."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none"})  # text stays text: selectable, and measurable in a browser
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.4), layout="constrained")
    train = metrics[metrics["kind"] == "train"]
    firsts = train.sort_values("update_no").groupby("run_id")["loss"].first()
    vals = metrics[metrics["kind"] == "val"]["loss"]
    finite = pd.concat([firsts, vals]).replace([math.inf, -math.inf], math.nan).dropna()
    top = 1.25 * float(finite.max()) if len(finite) else None  # above every first loss: a divergence
    clipped = []
    for r in runs.itertuples():
        m = metrics[metrics["run_id"] == r.run_id]
        label = f"{r.variant} · lr {r.lr:g} · seed {r.seed} · {r.run_id}"
        tr, va = m[m["kind"] == "train"], m[m["kind"] == "val"]
        line, = ax1.plot(tr["update_no"], tr["loss"].clip(upper=top) if top else tr["loss"], label=label,
                         linewidth=1)
        ax2.plot(va["update_no"], va["loss"], marker="o", color=line.get_color(), linewidth=1)
        above = tr[tr["loss"] > top] if top else tr.iloc[0:0]
        if len(above):
            first = above.iloc[0]
            ax1.plot([first["update_no"]], [top], marker="^", color=line.get_color())
            clipped.append(f"{r.variant} (lr {r.lr:g}) reached {first['loss']:.3g} at update {int(first['update_no'])}")
    from matplotlib.ticker import MaxNLocator

    for ax, title in ((ax1, "training loss (measured)"), (ax2, "validation loss (measured)")):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # updates are whole: no tick at 2.5
        ax.set_xlabel("update")
        ax.set_ylabel("loss")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    if top:
        ax1.set_ylim(top=top * 1.02)
    if clipped:
        ax1.set_title("training loss (measured; ▲ = off the axis)")
    n = len(runs)
    fig.legend(loc="outside lower center", ncol=min(3, max(n, 1)), fontsize=8, frameon=False)
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt)
    plt.close(fig)
    return buf.getvalue(), clipped


def campaign_frames(ledger_path: str, name: str | None):
    with Ledger(ledger_path, create=False) as led:
        runs, events, metrics, notes = (led.table(t) for t in ("campaign_runs", "campaign_events",
                                                                "campaign_metrics", "notes"))
    if name:
        runs = runs[runs["campaign"] == name]
    if runs.empty:
        raise InputError("no campaign runs in this ledger" + (f" for campaign {name!r}" if name else "")
                         + "; start with `rentplan campaign run campaign.yaml`.")
    return runs, events, metrics, notes


SHA = re.compile(r"\b([0-9a-f]{10})[0-9a-f]{30,}\b")
VARIANT_COLUMNS = {  # the report's columns: the rest stays in variants.csv
    "variant": "variant", "changes": "changes", "seeds": "seeds", "status": "status", "updates": "updates",
    "comparable": "comparable", "quality": "quality", "final val loss (mean ± spread)": None,
    "best_val_loss_mean": "best val loss", "final_val_accuracy_mean": "val accuracy", "hours": "hours",
    "cost_usd": "cost (USD)"}
RUN_COLUMNS = {"run_id": "run", "variant": "variant", "seed": "seed", "lr": "lr", "attempt": "attempt",
               "status": "status", "detail": "detail", "updates": "updates", "final_val_loss": "final val loss",
               "seconds": "billed s", "setup_s": "setup s", "device": "device"}


WRAP = {"status", "detail", "quality", "changes", "comparable"}  # sentences: wrapped; the rest on one line
WRAP_OVER = 24  # characters: a shorter sentence ("yes", "finished") stays on one line in a narrow column
DURATION = {"hours": "h", "seconds": "s", "setup_s": "s"}  # durations, each in the unit its column's name says


def _in_unit(x: float, unit: str) -> str:
    """A duration in the unit its column names (a column called hours never shows seconds): 3 significant
    digits in plain decimals (0.00168 h, never 1.68e-03), whole numbers from 100 up."""
    if x >= 100:
        return f"{x:,.0f} {unit}"
    return f"{x:.{max(0, 2 - math.floor(math.log10(x)))}f} {unit}" if x > 0 else f"0 {unit}"


def _cell(v, key: str = "") -> dict:
    """A table cell: the text shown, and the whole text as a tooltip where it was shortened (a sha256)."""
    if v is None or (isinstance(v, float) and v != v):
        return {"text": "", "title": "", "wrap": False}
    if key in DURATION:
        return {"text": _in_unit(float(v), DURATION[key]), "title": "", "wrap": False}
    if key == "cost_usd":
        return {"text": fmt_usd(float(v)), "title": "", "wrap": False}
    if isinstance(v, float):
        return {"text": f"{v:.4g}", "title": "", "wrap": False}
    text = str(v)
    short = SHA.sub(lambda m: m.group(1) + "…", text)
    return {"text": short, "title": text if short != text else "", "wrap": key in WRAP and len(short) > WRAP_OVER}


def _cells(df: pd.DataFrame, columns: dict) -> tuple[list[str], list[list[dict]]]:
    rows = []
    for r in df.to_dict(orient="records"):
        row = []
        for key in columns:
            if key == "final val loss (mean ± spread)":
                mean, spread = r.get("final_val_loss_mean"), r.get("final_val_loss_spread")
                row.append(_cell(None if mean is None or mean != mean else
                                 f"{mean:.4g} ± {spread:.2g}" if spread is not None and spread == spread
                                 else f"{mean:.4g}"))
            else:
                row.append(_cell(r.get(key), key))
        rows.append(row)
    return [label or key for key, label in columns.items()], rows


def write_campaign_report(out: Path, runs, table, variants, metrics, notes, said) -> list[Path]:
    """The report's files (_report_files); a folder made for them goes again when writing fails."""
    with made_or_nothing(out):
        return _report_files(out, runs, table, variants, metrics, notes, said)


def _report_files(out: Path, runs, table, variants, metrics, notes, said) -> list[Path]:
    """report.html (fits 1,200 px: the deciding columns, short ids with the full text as a tooltip),
    curves.svg/.png, and runs.csv and variants.csv with every column in full; returns what it wrote."""
    table = table.drop(columns=["outcome", "control", "quality_target"], errors="ignore")
    variants = variants.drop(columns=["outcome", "all_finished"], errors="ignore")
    from datetime import datetime, timezone

    svg_bytes, clipped = curves_figure(runs, metrics, "svg")
    svg = svg_bytes.decode()
    variant_columns, variant_rows = _cells(variants, {k: v for k, v in VARIANT_COLUMNS.items()
                                                      if k in variants or k.startswith("final val loss")})
    run_columns, run_rows = _cells(table, {k: v for k, v in RUN_COLUMNS.items() if k in table})
    ctx = {"campaign": ", ".join(sorted(set(runs["campaign"]))), "version": __version__,
           "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "n_runs": len(table),
           "conclusion": said, "variant_columns": variant_columns, "variants": variant_rows,
           "run_columns": run_columns, "runs": run_rows, "svg": svg[svg.find("<svg"):],
           "devices": ", ".join(sorted(set(runs["device_name"]))), "clipped": clipped,
           "notes": notes.to_dict(orient="records")}
    write_all({out / "report.html": render_template("campaign_report.html.j2", ctx), out / "curves.svg": svg,
               out / "curves.png": curves_figure(runs, metrics, "png")[0],
               out / "runs.csv": table.to_csv(index=False), out / "variants.csv": variants.to_csv(index=False)})
    return [out / name for name in ("report.html", "curves.svg", "curves.png", "runs.csv", "variants.csv")]
