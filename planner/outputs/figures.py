"""Pictures for the HTML order sheet (matplotlib, inline SVG so the page stands alone and works offline).

Allocated and reserved peaks are drawn side by side, never stacked: they are not added. Every picture
comes with a caption naming its basis. Text stays text in the SVG (searchable, and checked by the tests:
labels that overlap or a legend over the bars are layout bugs). Without matplotlib (the `report` extra)
the sheet has no pictures and says so.
"""

from __future__ import annotations

import io

import pandas as pd

from planner.models.memory_model import MB_LIMIT
from planner.records import PHASES
from planner.units import MiB

FONT = 10


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "font.size": FONT})
    return plt


def _svg(fig) -> str:
    plt = _plt()
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.find("<svg"):]  # inline: drop the XML prologue


def _basis(lines: pd.DataFrame) -> str:
    parts = []
    for (mode, device, name), g in lines.groupby(["mode", "device", "device_name"]):
        parts.append(f"{mode} on {device} ({name}), torch {g['torch_version'].iloc[0]}")
    return "; ".join(parts)


def spread_labels(values: list[float], min_gap: float) -> list[float]:
    """Label positions (in the axis' units, ascending input) moved apart to at least min_gap, none below its value."""
    out: list[float] = []
    for v in values:
        out.append(max(v, out[-1] + min_gap) if out else v)
    return out


def label_gpus(ax, marks: pd.DataFrame, fig) -> None:
    """GPU names at the right of the last panel, beside their dashed lines, moved apart (in screen space) so
    that no label covers another."""
    import math

    lo, hi = (math.log10(v) for v in ax.get_ylim())
    height_px = ax.get_window_extent().height or 1.0
    gap = (FONT * 1.6) / height_px * (hi - lo)  # one line of text, in log10 units of this axis
    logs = spread_labels([math.log10(float(u) / MiB) for u in marks["usable_bytes"]], gap)
    for (_, g), y in zip(marks.iterrows(), logs):
        ax.annotate(f"{g['gpu']} ({g['usable_bytes'] / 2**30:.0f} GiB)", xy=(len(PHASES) - 0.5, 10 ** y),
                    xytext=(6, 0), textcoords="offset points", fontsize=FONT - 1, va="center", annotation_clip=False)


def _reserved(rows: pd.DataFrame) -> pd.Series:
    measured = rows["peak_reserved_bytes"].astype(float)
    simulated = rows.get("simulated_reserved_bytes", pd.Series(float("nan"), index=rows.index)).astype(float)
    return measured.where(measured.notna(), simulated)


def memory_figure(lines: pd.DataFrame, sheet: pd.DataFrame, max_configs: int = 3):
    """Peaks per phase for the planned shape first (the probed configuration nearest the ordered micro-batch and
    seq_len), then the largest others; usable memory of candidate GPUs as labelled lines."""
    plt = _plt()
    ok = lines[(lines["verdict"] == "ok") & (lines["rank"] == 0)] if "rank" in lines else lines[lines["verdict"] == "ok"]
    pick = "ordered" if "ordered" in sheet and sheet["ordered"].any() else "recommended"
    rec = sheet[sheet[pick]].iloc[0] if pick in sheet and sheet[pick].any() else sheet.iloc[0]
    used = [r for r in str(rec.get("run_ids") or "").split(", ") if r]
    if used and ok["run_id"].isin(used).any():  # the runs that sized the recommendation
        ok = ok[ok["run_id"].isin(used)]
    runs = ok.drop_duplicates("run_id").assign(tokens=lambda d: d["micro_batch"] * d["seq_len"])
    want = int(rec["micro_batch"]) * int(rec["seq_len"])
    runs = runs.assign(distance=(runs["tokens"] - want).abs()).sort_values(["distance", "tokens"])
    planned = runs["run_id"].iloc[0]
    others = runs[runs["run_id"] != planned].sort_values("tokens", ascending=False)["run_id"].head(max_configs - 1)
    configs = [planned, *others]
    fig, axes = plt.subplots(1, len(configs), figsize=(5.2 * len(configs), 4.6), sharey=True, squeeze=False)
    gpus = sheet.drop_duplicates("gpu").sort_values("usable_bytes")
    # The ordered GPU, the largest that do not fit, and the next sizes up from the ordered one.
    bigger = gpus[gpus["usable_bytes"] > rec["usable_bytes"]].head(1)
    marks = pd.concat([sheet.loc[[rec.name]], gpus[gpus["verdict"] == "does not fit"].tail(2), bigger])
    marks = marks.drop_duplicates("usable_bytes").sort_values("usable_bytes")
    has_reserved = bool(_reserved(ok).notna().any())
    simulated = not ok["peak_reserved_bytes"].notna().any()
    top = max(float(ok["peak_allocated_bytes"].max()), float(_reserved(ok).max() if has_reserved else 0),
              float(marks["usable_bytes"].max()) if len(marks) else 0) / MiB
    for i, (ax, run_id) in enumerate(zip(axes[0], configs)):
        rows = ok[ok["run_id"] == run_id].drop_duplicates("phase", keep="last").set_index("phase").reindex(PHASES)
        x = range(len(PHASES))
        ax.bar([k - 0.2 for k in x], rows["peak_allocated_bytes"] / MiB, width=0.4, label="allocated peak",
               color="#4c72b0")
        if has_reserved:
            ax.bar([k + 0.2 for k in x], _reserved(rows) / MiB, width=0.4, color="#dd8452",
                   label="reserved peak (simulated)" if simulated else "reserved peak")
        levels = [float(u) / MiB for u in marks["usable_bytes"]]
        for level in levels:
            ax.axhline(level, linestyle="--", linewidth=0.8, color="grey")
        r = rows.dropna(subset=["micro_batch"]).iloc[0]
        tag = "planned shape, nearest probed" if run_id == planned else "probed"
        ck = ", checkpointing on" if bool(r["checkpointing"]) else ", checkpointing off"
        ranks = f", {r['strategy']} × {int(r['world_size'])} rank 0" if r["world_size"] > 1 else ""
        ax.set_title(f"{tag}: mb {int(r['micro_batch'])} × seq {int(r['seq_len'])}\n{r['precision']}{ck}{ranks}",
                     fontsize=FONT)
        ax.set_xticks(list(x), PHASES, rotation=40, ha="right")
        ax.set_yscale("log")
        ax.set_ylim(top=top * 1.6)
    axes[0][0].set_ylabel("MiB (log scale)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=2, bbox_to_anchor=(0.5, 1.02), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    label_gpus(axes[0][-1], marks, fig)
    why = "" if has_reserved else " There is no reserved bar: these lines carry no reserved figure."
    sim = " Reserved bars are simulated by the model of CUDA's caching allocator." if simulated and has_reserved else ""
    first = ok[ok["run_id"] == planned].iloc[0]
    caption = (f"Peak memory per phase, allocated and reserved side by side (never added); the first panel is the "
               f"probed configuration nearest the planned shape (probed micro-batch {int(first['micro_batch'])} × seq "
               f"{int(first['seq_len'])}; the order runs micro-batch {int(rec['micro_batch'])} × seq "
               f"{int(rec['seq_len'])} on {rec['gpu']}), the others the largest probed; dashed lines are the usable "
               f"memory of candidate GPUs, the ordered one among them.{sim} Basis: {_basis(ok)}.{why}")
    return fig, caption


def memory_per_phase(lines: pd.DataFrame, sheet: pd.DataFrame) -> dict:
    fig, caption = memory_figure(lines, sheet)
    return {"svg": _svg(fig), "caption": caption}


def cost_figure(plans: pd.DataFrame, max_offers: int = 8):
    """Predicted cost (slow end) per offer for each window; None when every window costs the same for every
    offer (then the hours used are the whole story: the plans table says so)."""
    if plans.empty:
        return None
    costs = plans.pivot_table(index="offer", columns="days", values="cost_usd_high", aggfunc="first")
    if (costs.nunique(axis=1, dropna=False) <= 1).all():
        return None
    plt = _plt()
    offers = plans.groupby("offer")["cost_usd_high"].max().sort_values().head(max_offers).index.tolist()
    days = sorted(plans["days"].unique())
    fig, ax = plt.subplots(figsize=(10, 4.2))
    width = 0.8 / len(days)
    for i, d in enumerate(days):
        sub = plans[plans["days"] == d].set_index("offer").reindex(offers)
        ax.bar([k + i * width for k in range(len(offers))], sub["cost_usd_high"], width=width, label=f"{d} days")
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(offers))], offers, rotation=30, ha="right")
    ax.set_ylabel("USD (slow end)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    caption = ("Predicted cost per offer for each window: the variants that fit the window, setup included, at the "
               "slow end of each time range; a window that leaves variants out costs less and says which in the "
               "plans table. Basis: the time basis of each offer's row in the selection; prices as of each "
               "offer's date.")
    return fig, caption


def cost_per_window(plans: pd.DataFrame) -> dict | None:
    made = cost_figure(plans)
    return None if made is None else {"svg": _svg(made[0]), "caption": made[1]}


def max_mb_figure(sheet: pd.DataFrame):
    """The largest micro-batch that fits each GPU at the campaign's sequence length; search limits marked."""
    plt = _plt()
    per_gpu = sheet.sort_values("usable_bytes").drop_duplicates("gpu")
    fig, ax = plt.subplots(figsize=(10, 4.0))
    values = per_gpu["max_micro_batch"].clip(lower=0.5)
    bars = ax.bar(per_gpu["gpu"], values, color="#4c72b0")
    for bar, extrap, mb in zip(bars, per_gpu["max_micro_batch_extrapolated"], per_gpu["max_micro_batch"]):
        if extrap:
            bar.set_hatch("//")
        if mb >= MB_LIMIT:
            ax.annotate(f"≥ {MB_LIMIT} (search limit)", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        xytext=(0, 3), textcoords="offset points", ha="center", fontsize=FONT - 2)
        elif mb == 0:
            ax.annotate("does not fit", (bar.get_x() + bar.get_width() / 2, 0.5), xytext=(0, 3),
                        textcoords="offset points", ha="center", fontsize=FONT - 2, rotation=90)
    ax.set_yscale("log", base=2)
    ax.set_ylabel("max micro-batch (log2)")
    ax.set_xticks(range(len(per_gpu)), per_gpu["gpu"], rotation=45, ha="right")
    fig.tight_layout()
    seq = int(sheet["seq_len"].iloc[0]) if len(sheet) else 0
    caption = (f"Largest micro-batch per GPU at seq_len {seq}, from the fitted memory model with the headroom, "
               f"CUDA context and workspaces; hatched bars are extrapolated beyond the probed sizes; a bar at the "
               f"search limit means at least that many. Basis: {sheet['need_basis'].iloc[0] if len(sheet) else ''}.")
    return fig, caption


def max_micro_batch(sheet: pd.DataFrame) -> dict:
    fig, caption = max_mb_figure(sheet)
    return {"svg": _svg(fig), "caption": caption}


def order_sheet_figures(lines: pd.DataFrame, sheet: pd.DataFrame, plans: pd.DataFrame) -> list[dict]:
    if not available():
        return []
    figs = [memory_per_phase(lines, sheet), cost_per_window(plans), max_micro_batch(sheet)]
    return [f for f in figs if f]


__all__ = ["order_sheet_figures", "available"]
