"""Campaign report: one row per variant (seeds as mean and spread, never best-of), a stated conclusion,
and loss curves as SVG/PNG. Reads the ledger's campaign tables; no torch (matplotlib only for pictures)."""

from __future__ import annotations

import io
import math
import statistics

import pandas as pd

from planner.errors import LedgerError


def run_table(runs: pd.DataFrame, events: pd.DataFrame, metrics: pd.DataFrame) -> pd.DataFrame:
    """One row per run: status from its latest event, updates done, final/best validation loss, time."""
    rows = []
    for r in runs.itertuples():
        ev = events[events["run_id"] == r.run_id]
        last = ev.iloc[-1] if len(ev) else None
        m = metrics[metrics["run_id"] == r.run_id]
        train, val = m[m["kind"] == "train"], m[m["kind"] == "val"]
        status = "running or crashed" if last is None or last["event"] in ("started",) else last["event"]
        if status == "diverged":
            status = f"diverged at update {int(last['update_no'])}"
        rows.append({
            "run_id": r.run_id, "variant": r.variant, "seed": r.seed, "lr": r.lr, "status": status,
            "detail": "" if last is None else last["detail"],
            "updates": int(train["update_no"].max()) if len(train) else 0,
            "final_val_loss": float(val["loss"].iloc[-1]) if len(val) else None,
            "best_val_loss": float(val["loss"].min()) if len(val) else None,
            "final_val_accuracy": float(val["accuracy"].iloc[-1]) if len(val) and pd.notna(val["accuracy"].iloc[-1])
            else None,
            "seconds": float(m["seconds"].sum()), "device": r.device_name, "started_at": r.started_at,
        })
    return pd.DataFrame(rows)


def variant_table(runs: pd.DataFrame, price_per_hour: float | None = None) -> pd.DataFrame:
    """Seeds of a variant as mean ± spread (sample std); the latest attempt per (variant, lr, seed) counts."""
    rows = []
    for (variant, lr), g in runs.groupby(["variant", "lr"], sort=False):
        latest = g.groupby("seed").tail(1)
        finals = [x for x in latest["final_val_loss"] if x is not None and not math.isnan(x)]
        finished = latest["status"].eq("finished")
        statuses = sorted(set(latest["status"]))
        rows.append({
            "variant": variant, "lr": lr, "seeds": len(latest), "status": ", ".join(statuses),
            "updates": int(latest["updates"].max()),
            "final_val_loss_mean": statistics.mean(finals) if finals else None,
            "final_val_loss_spread": statistics.stdev(finals) if len(finals) > 1 else (0.0 if finals else None),
            "best_val_loss_mean": statistics.mean([x for x in latest["best_val_loss"] if x is not None] or [math.nan]),
            "all_finished": bool(finished.all()),
            "hours": latest["seconds"].sum() / 3600,
            "cost_usd": (latest["seconds"].sum() / 3600 * price_per_hour) if price_per_hour else None,
            "attempts": len(g),
        })
    return pd.DataFrame(rows)


def conclusion(variants: pd.DataFrame, control: str = "control") -> str:
    """A sentence someone can reread: who is best, who diverged, whether the spread allows a call."""
    if variants.empty:
        raise LedgerError("no campaign runs to report; run `rentplan campaign run` first.")
    parts = []
    for r in variants.itertuples():
        if "diverged" in r.status:
            parts.append(f"{r.variant} (lr {r.lr:g}) {r.status.split(', ')[0]}")
    done = variants[variants["all_finished"] & variants["final_val_loss_mean"].notna()]
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


def curves_figure(runs: pd.DataFrame, metrics: pd.DataFrame, fmt: str = "svg") -> bytes:
    """Training and validation loss per run; a diverged run's curve ends where it stopped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs.itertuples():
        m = metrics[metrics["run_id"] == r.run_id]
        label = f"{r.variant} (lr {r.lr:g}, seed {r.seed}) {r.run_id}"
        tr, va = m[m["kind"] == "train"], m[m["kind"] == "val"]
        ax1.plot(tr["update_no"], tr["loss"], label=label, linewidth=1)
        ax2.plot(va["update_no"], va["loss"], marker="o", label=label, linewidth=1)
    for ax, title in ((ax1, "training loss (measured)"), (ax2, "validation loss (measured)")):
        ax.set_xlabel("update")
        ax.set_ylabel("loss")
        ax.set_title(title)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt)
    plt.close(fig)
    return buf.getvalue()
