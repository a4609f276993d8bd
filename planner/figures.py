"""Pictures for the HTML order sheet (matplotlib, inline SVG so the page stands alone and works offline).

Allocated and reserved peaks are drawn side by side, never stacked: they are not added. Every picture
comes with a caption naming its basis. Without matplotlib (the `report` extra) the sheet has no pictures
and says so.
"""

from __future__ import annotations

import io

import pandas as pd

from planner.records import PHASES
from planner.units import MiB


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _svg(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.find("<svg"):]  # inline: drop the XML prologue


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _basis(lines: pd.DataFrame) -> str:
    parts = []
    for (mode, device, name), g in lines.groupby(["mode", "device", "device_name"]):
        parts.append(f"{mode} on {device} ({name}), torch {g['torch_version'].iloc[0]}")
    return "; ".join(parts)


def memory_per_phase(lines: pd.DataFrame, sheet: pd.DataFrame, max_configs: int = 4) -> dict:
    """Per configuration: allocated and reserved peaks per phase, side by side, against usable memory."""
    plt = _plt()
    ok = lines[lines["verdict"] == "ok"]
    ok = ok[ok["rank"] == 0] if "rank" in ok else ok
    configs = (ok.assign(tokens=ok["micro_batch"] * ok["seq_len"])
               .sort_values("tokens", ascending=False)["run_id"].drop_duplicates().head(max_configs).tolist())
    fig, axes = plt.subplots(1, max(1, len(configs)), figsize=(4.2 * max(1, len(configs)), 3.6), sharey=True,
                             squeeze=False)
    gpus = sheet.drop_duplicates("gpu").sort_values("usable_bytes")
    marks = pd.concat([gpus[gpus["verdict"] != "does not fit"].head(3), gpus[gpus["verdict"] == "does not fit"].tail(1)])
    has_reserved = ok["peak_reserved_bytes"].notna().any()
    for ax, run_id in zip(axes[0], configs):
        rows = ok[ok["run_id"] == run_id].set_index("phase").reindex(PHASES)
        x = range(len(PHASES))
        ax.bar([i - 0.2 for i in x], rows["peak_allocated_bytes"] / MiB, width=0.4, label="allocated peak")
        if has_reserved:
            ax.bar([i + 0.2 for i in x], rows["peak_reserved_bytes"] / MiB, width=0.4, label="reserved peak")
        for _, g in marks.iterrows():
            ax.axhline(g["usable_bytes"] / MiB, linestyle="--", linewidth=0.8, color="grey")
            ax.text(len(PHASES) - 0.5, g["usable_bytes"] / MiB, f" {g['gpu']}", fontsize=7, va="bottom", ha="right")
        r = rows.dropna(subset=["micro_batch"]).iloc[0]
        ranks = f", {r['strategy']} × {int(r['world_size'])} rank 0" if r["world_size"] > 1 else ""
        ax.set_title(f"mb {int(r['micro_batch'])} × seq {int(r['seq_len'])}, {r['precision']}{ranks}", fontsize=9)
        ax.set_xticks(list(x), PHASES, rotation=45, fontsize=7)
        ax.set_yscale("log")
    axes[0][0].set_ylabel("MiB (log scale)")
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    why = "" if has_reserved else " There is no reserved bar: the device has no caching allocator (CPU)."
    return {"svg": _svg(fig), "caption": f"Peak memory per phase, allocated and reserved side by side (never "
                                         f"added), against the usable memory of candidate GPUs (dashed). "
                                         f"Basis: {_basis(ok)}.{why}"}


def cost_per_window(plans: pd.DataFrame, max_offers: int = 8) -> dict | None:
    """Predicted cost (slow end of the range) per offer, for each window."""
    if plans.empty:
        return None
    plt = _plt()
    offers = (plans.groupby("offer")["cost_usd_high"].max().sort_values().head(max_offers).index.tolist())
    days = sorted(plans["days"].unique())
    fig, ax = plt.subplots(figsize=(9, 3.6))
    width = 0.8 / len(days)
    for i, d in enumerate(days):
        sub = plans[plans["days"] == d].set_index("offer").reindex(offers)
        ax.bar([k + i * width for k in range(len(offers))], sub["cost_usd_high"], width=width, label=f"{d} days")
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(offers))], offers, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("USD (slow end)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    hours = plans.groupby("offer")["hours_used_high"].max().reindex(offers)
    span = f"{hours.min():.2f}–{hours.max():.2f} h" if len(hours) else ""
    return {"svg": _svg(fig), "caption": f"Predicted cost per offer for each window (variants that fit the "
                                         f"window, setup included; {span} of use), at the slow end of each "
                                         f"time range. Basis: the time basis of each offer's row in the "
                                         f"selection; prices as of each offer's date."}


def max_micro_batch(sheet: pd.DataFrame) -> dict:
    """The largest micro-batch that fits each GPU at the campaign's sequence length."""
    plt = _plt()
    per_gpu = sheet.sort_values("usable_bytes").drop_duplicates("gpu")
    fig, ax = plt.subplots(figsize=(9, 3.4))
    bars = ax.bar(per_gpu["gpu"], per_gpu["max_micro_batch"])
    for bar, extrap in zip(bars, per_gpu["max_micro_batch_extrapolated"]):
        if extrap:
            bar.set_hatch("//")
    ax.set_ylabel("max micro-batch")
    ax.set_xticks(range(len(per_gpu)), per_gpu["gpu"], rotation=45, ha="right", fontsize=7)
    fig.tight_layout()
    seq = int(sheet["seq_len"].iloc[0]) if len(sheet) else 0
    return {"svg": _svg(fig), "caption": f"Largest micro-batch per GPU at seq_len {seq}, from the fitted memory "
                                         f"model with the headroom and CUDA context; hatched bars are "
                                         f"extrapolated beyond the probed sizes. Basis: "
                                         f"{sheet['need_basis'].iloc[0] if len(sheet) else ''}."}


def order_sheet_figures(lines: pd.DataFrame, sheet: pd.DataFrame, plans: pd.DataFrame) -> list[dict]:
    if not available():
        return []
    figs = [memory_per_phase(lines, sheet), cost_per_window(plans), max_micro_batch(sheet)]
    return [f for f in figs if f]


__all__ = ["order_sheet_figures", "available"]
