"""Pictures for the HTML order sheet (matplotlib, inline SVG so the page stands alone and works offline).

Allocated and reserved peaks are drawn side by side, never stacked: they are not added. Every picture
comes with a caption naming its basis. Text stays text in the SVG (searchable, and checked by the tests:
labels that overlap or a legend over the bars are layout bugs). Without matplotlib (the `report` extra)
the sheet has no pictures and says so.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import pandas as pd

from planner.decisions.shapes import input_kind_of
from planner.models.memory_model import MB_LIMIT
from planner.records import PHASES
from planner.shapes import size_text
from planner.units import GiB, MiB, fmt_hours

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


def fit_limit(row, headroom: float) -> float:
    """The most a configuration may need on this GPU and still fit with the headroom (the fit rule:
    (need + context) × (1 + headroom) ≤ usable)."""
    return float(row["usable_bytes"]) / (1 + headroom) - float(row["context_bytes"])


def _reserved(rows: pd.DataFrame) -> pd.Series:
    measured = rows["peak_reserved_bytes"].astype(float)
    simulated = rows.get("simulated_reserved_bytes", pd.Series(float("nan"), index=rows.index)).astype(float)
    return measured.where(measured.notna(), simulated)


@dataclass(frozen=True)
class GpuMark:
    """One candidate GPU on the memory figure: the fit rule's limit (a solid line), its usable memory (dotted)."""
    limit: float
    usable: float
    color: str
    width: float
    text: str


@dataclass(frozen=True)
class MemoryPanel:
    """One configuration's panel: its peaks per phase (PHASES order; NaN where a phase has no line) and title."""
    allocated: pd.Series
    reserved: pd.Series
    title: str


@dataclass(frozen=True)
class MemoryChoice:
    """What the memory figure draws, chosen from the lines and the sheet (no drawing, no matplotlib)."""
    panels: list[MemoryPanel]
    gpus: list[GpuMark]
    top: float  # the axis's top, in bytes
    unit: str
    scale: float
    has_reserved: bool
    simulated: bool
    caption: str


def _configs(ok: pd.DataFrame, rec: pd.Series, max_configs: int) -> tuple[str, list[str]]:
    """The run nearest the planned shape (micro-batch × seq_len), then the largest others."""
    runs = ok.drop_duplicates("run_id").assign(tokens=lambda d: d["micro_batch"] * d["seq_len"])
    want = int(rec["micro_batch"]) * int(rec["seq_len"])
    runs = runs.assign(distance=(runs["tokens"] - want).abs()).sort_values(["distance", "tokens"])
    planned = runs["run_id"].iloc[0]
    others = runs[runs["run_id"] != planned].sort_values("tokens", ascending=False)["run_id"].head(max_configs - 1)
    return planned, [planned, *others]


def _gpu_marks(sheet: pd.DataFrame, rec: pd.Series, peak: float, headroom: float) -> tuple[float, list[GpuMark]]:
    """The axis's top and the GPUs marked on it: the ordered one, the largest that do not fit, the next size up."""
    gpus = sheet.drop_duplicates("gpu").sort_values("usable_bytes")
    bigger = gpus[gpus["usable_bytes"] > rec["usable_bytes"]].head(1)
    marks = pd.concat([sheet.loc[[rec.name]], gpus[gpus["verdict"] == "does not fit"].tail(2), bigger])
    marks = marks.drop_duplicates("usable_bytes").sort_values("usable_bytes")
    limits = [fit_limit(g, headroom) for _, g in marks.iterrows()]
    # The axis holds the bars and the GPU lines near them; lines far above small bars would flatten them to
    # nothing, so those GPUs are named in the legend with their limit instead of drawn.
    top = max([peak * 1.25, *(x * 1.08 for x in limits if x <= peak * 4)])
    colors = ["#7f7f7f", "#9467bd", "#8c564b", "#17becf", "#bcbd22"]
    gpu_marks = []
    for k, ((_, g), limit) in enumerate(zip(marks.iterrows(), limits)):
        ordered_gpu = g["offer"] == rec["offer"]
        strategy = f", {g['strategy_label']}" if str(g.get("strategy", "single")) != "single" else ""
        text = (f"{g['gpu']}{strategy}{' (ordered)' if ordered_gpu else ''}: fits below {limit / GiB:.1f} of "
                f"{float(g['usable_bytes']) / GiB:.0f} GiB")
        gpu_marks.append(GpuMark(limit, float(g["usable_bytes"]), "black" if ordered_gpu else colors[k % len(colors)],
                                 1.6 if ordered_gpu else 1.0, text + ("" if limit <= top else " (above this axis)")))
    return top, gpu_marks


def choose_memory(lines: pd.DataFrame, sheet: pd.DataFrame, max_configs: int = 3,
                  headroom: float = 0.10) -> MemoryChoice:
    """Peaks per phase for the planned shape first (the probed configuration nearest the ordered micro-batch and
    seq_len), then the largest others; usable memory of candidate GPUs as labelled lines. Pure: memory_figure
    draws it."""
    ok = (lines[(lines["verdict"] == "ok") & (lines["rank"] == 0)] if "rank" in lines
          else lines[lines["verdict"] == "ok"])
    pick = "ordered" if "ordered" in sheet and sheet["ordered"].any() else "recommended"
    kind = input_kind_of(sheet)  # an image's size is positions, not a sequence
    rec = sheet[sheet[pick]].iloc[0] if pick in sheet and sheet[pick].any() else sheet.iloc[0]
    used = [r for r in str(rec.get("run_ids") or "").split(", ") if r]
    if used and ok["run_id"].isin(used).any():  # the runs that sized the recommendation
        ok = ok[ok["run_id"].isin(used)]
    planned, configs = _configs(ok, rec, max_configs)
    has_reserved = bool(_reserved(ok).notna().any())
    simulated = not ok["peak_reserved_bytes"].notna().any()
    peak = max(float(ok["peak_allocated_bytes"].max()), float(_reserved(ok).max() if has_reserved else 0))
    top, gpu_marks = _gpu_marks(sheet, rec, peak, headroom)
    unit, scale = ("GiB", GiB) if top >= GiB else ("MiB", MiB)
    panels = []
    for run_id in configs:
        rows = ok[ok["run_id"] == run_id].drop_duplicates("phase", keep="last").set_index("phase").reindex(PHASES)
        r = rows.dropna(subset=["micro_batch"]).iloc[0]
        tag = "planned shape, nearest probed" if run_id == planned else "probed"
        ck = ", checkpointing on" if bool(r["checkpointing"]) else ", checkpointing off"
        ranks = f", {r['strategy']} × {int(r['world_size'])} rank 0" if r["world_size"] > 1 else ""
        panels.append(MemoryPanel(rows["peak_allocated_bytes"], _reserved(rows),
                                  f"{tag}: mb {int(r['micro_batch'])} × {size_text(kind, int(r['seq_len']))}\n"
                                  f"{r['precision']}{ck}{ranks}"))
    why = "" if has_reserved else " There is no reserved bar: these lines carry no reserved figure."
    sim = " Reserved bars are simulated by the model of CUDA's caching allocator." if simulated and has_reserved else ""
    first = ok[ok["run_id"] == planned].iloc[0]
    caption = (f"Peak memory per phase, allocated and reserved side by side (never added); the first panel is the "
               f"probed configuration nearest the planned shape (probed micro-batch {int(first['micro_batch'])} × "
               f"{size_text(kind, int(first['seq_len']))}; the order runs micro-batch {int(rec['micro_batch'])} × "
               f"{size_text(kind, int(rec['seq_len']))} on {rec['gpu']}), the others the largest probed. "
               f"Per candidate GPU (the "
               f"ordered one in black): the dotted line is its usable memory, the solid line the most a phase may need "
               f"and fit by the rule (usable ÷ (1 + {headroom:.0%} headroom) − CUDA context and workspaces).{sim} "
               f"Basis: {_basis(ok)}.{why}")
    return MemoryChoice(panels, gpu_marks, top, unit, scale, has_reserved, simulated, caption)


def memory_figure(lines: pd.DataFrame, sheet: pd.DataFrame, max_configs: int = 3, headroom: float = 0.10):
    """The memory figure (choose_memory's choice, drawn) and its caption."""
    choice = choose_memory(lines, sheet, max_configs, headroom)
    return draw_memory(choice), choice.caption


def draw_memory(choice: MemoryChoice):
    """Allocated and reserved bars per phase, one panel per configuration, GPU lines and a legend below."""
    plt = _plt()
    n, scale, top = len(choice.panels), choice.scale, choice.top
    fig, axes = plt.subplots(1, n, figsize=(max(5.0, 4.0 * n), 5.6), sharey=True, squeeze=False)
    x = range(len(PHASES))
    for ax, panel in zip(axes[0], choice.panels):
        ax.bar([k - 0.2 for k in x], panel.allocated / scale, width=0.4, label="allocated peak", color="#4c72b0")
        if choice.has_reserved:
            ax.bar([k + 0.2 for k in x], panel.reserved / scale, width=0.4, color="#dd8452",
                   label="reserved peak (simulated)" if choice.simulated else "reserved peak")
        for g in choice.gpus:  # the fit rule's limit (solid), usable memory (dotted)
            if g.limit <= top:
                ax.axhline(g.limit / scale, linestyle="-", linewidth=g.width, color=g.color, label=g.text)
            if g.usable <= top:
                ax.axhline(g.usable / scale, linestyle=":", linewidth=0.8, color=g.color)
        ax.set_title(panel.title, fontsize=FONT)
        ax.set_xticks(list(x), PHASES, rotation=50, ha="right", fontsize=FONT - 1)
        ax.set_ylim(0, top / scale)
    axes[0][0].set_ylabel(choice.unit)
    handles, labels = axes[0][0].get_legend_handles_labels()
    from matplotlib.lines import Line2D

    for g in choice.gpus:  # GPUs above the axis still appear in the legend
        if g.limit > top:
            handles.append(Line2D([], [], color=g.color, linewidth=g.width, linestyle="-"))
            labels.append(g.text)
    fig.legend(handles, labels, loc="lower center", ncol=1 if n == 1 else 2, bbox_to_anchor=(0.5, 0.0),
               frameon=False, fontsize=FONT - 1)
    rows_below = -(-len(labels) // (1 if n == 1 else 2))
    fig.tight_layout(rect=(0, min(0.5, 0.055 * rows_below + 0.02), 1, 1))
    return fig


def memory_per_phase(lines: pd.DataFrame, sheet: pd.DataFrame, headroom: float) -> dict:
    fig, caption = memory_figure(lines, sheet, headroom=headroom)
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
    """The largest micro-batch that fits each GPU at the campaign's sequence length, as horizontal bars (names
    read level), on a log2 axis labelled with the micro-batches themselves; a GPU that holds none says so in
    words, not with a bar; the search limit is marked."""
    from matplotlib.ticker import FixedLocator, NullLocator

    plt = _plt()
    per_gpu = sheet.sort_values("usable_bytes").drop_duplicates("gpu")
    n = len(per_gpu)
    fig, ax = plt.subplots(figsize=(7.4, 0.32 * n + 1.2))
    values = per_gpu["max_micro_batch"].astype(float)
    top = max(2.0, float(values.max()))
    y = list(range(n))
    # a bar runs from the axis' left edge (0.5) to its micro-batch: barh's width is that length, not the value
    bars = ax.barh(y, values.where(values > 0, float("nan")) - 0.5, color="#4c72b0", height=0.6, left=0.5)
    for yi, bar, extrap, mb in zip(y, bars, per_gpu["max_micro_batch_extrapolated"], per_gpu["max_micro_batch"]):
        if mb > 0 and extrap:
            bar.set_hatch("//")
        if mb >= MB_LIMIT:
            label = f"≥ {MB_LIMIT:,} (search limit)"
        elif mb == 0:
            label = "does not fit at micro-batch 1"
        else:
            label = f"{int(mb):,}"
        ax.annotate(label, (max(float(mb), 0.5), yi), xytext=(5, 0), textcoords="offset points", va="center",
                    fontsize=FONT - 2, bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none"})
    ax.set_xscale("log", base=2)
    last = int(top * 8).bit_length()
    ticks = [2 ** k for k in range(0, last, max(1, -(-last // 6)))]  # at most 6 labels: none touch
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([f"{t:,}" for t in ticks])
    ax.set_xlim(0.5, top * 8)
    ax.set_ylim(-0.8, n - 0.2)  # room below the first row's words, above the axis line
    # each bar names the kernel basis its GPU was sized from (GPUs of one basis read one set of lines); † where
    # its own basis had no lines
    bases = per_gpu.get("kernel_basis", pd.Series("", index=per_gpu.index)).fillna("")
    fallback = per_gpu.get("kernel_basis_note", pd.Series("", index=per_gpu.index)).fillna("") != ""
    ax.set_yticks(y, [f"{g} ({u / 2**30:.0f} GiB{f', {b}' if b else ''}{' †' if f else ''})"
                      for g, u, b, f in zip(per_gpu["gpu"], per_gpu["usable_bytes"], bases, fallback)])
    ax.set_xlabel("largest micro-batch that fits (log scale)")
    fig.tight_layout()
    seq = int(sheet["seq_len"].iloc[0]) if len(sheet) else 0
    caption = (f"Largest micro-batch per GPU at {size_text(input_kind_of(sheet), seq)}, from the fitted memory model "
               f"with the headroom, "
               f"CUDA context and workspaces; hatched bars are extrapolated beyond the probed sizes; a bar at the "
               f"search limit means at least that many. "
               + ("Kernel basis in brackets: each GPU sized from the lines of the kernels it dispatches"
                  + ("; † its own basis had no lines, sized from the nearest that had" if fallback.any() else "")
                  + ". " if bases.any() else "")
               + "Basis: " + "; ".join(f"{b + ': ' if b else ''}{n}" for b, n in
                                       per_gpu.assign(_b=bases).drop_duplicates("_b")[["_b", "need_basis"]].values)
               + ".")
    return fig, caption


def max_micro_batch(sheet: pd.DataFrame) -> dict:
    fig, caption = max_mb_figure(sheet)
    return {"svg": _svg(fig), "caption": caption}


VERDICT_COLORS = {"fits": "#2a7a3b", "tight": "#b8860b"}


def _money(v, _=None) -> str:
    return f"${v:,.0f}" if v >= 10 else (f"${v:.2f}" if v >= 1 else f"{v * 100:.0f}¢")


def _hours(v, _=None) -> str:
    if v >= 1:
        return f"{v:,.0f} h"
    return f"{v * 60:.0f} min" if v >= 1 / 60 else f"{v * 3600:.2g} s"  # a campaign of seconds: never "0 min"


def decision_figure(sheet: pd.DataFrame, plans: pd.DataFrame, max_labels: int = 4, setup_hours: float = 0.0):
    """The decision in one picture: every offer that fits or is tight, campaign cost (x) against the variants'
    hours (y: the campaign's hours less the setup, which is the same for every offer and said in the caption, so
    that a long setup does not put every offer on one line), each with its range (fast end – slow end) in both;
    colour by verdict; the recommendation ringed, the ordered offer boxed where it differs, each window's ★; the
    rental windows less the setup as lines. Both axes are logarithmic: the offers span orders of magnitude in
    both, and equal ratios read as equal distances."""
    ok = sheet[(sheet["verdict"] != "does not fit") & sheet["campaign_cost_usd_high"].notna()
               & sheet["campaign_hours_high"].notna()]
    if ok.empty:
        return None
    ok = ok.assign(work_hours_low=ok["campaign_hours_low"].astype(float) - setup_hours,
                   work_hours_high=ok["campaign_hours_high"].astype(float) - setup_hours)
    from matplotlib.ticker import FuncFormatter

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.4, 4.6))
    modelled = ok["unmodelled"].fillna("") == "" if "unmodelled" in ok else pd.Series(True, index=ok.index)
    groups = [(f"{v} ({len(g)} offers)", g, VERDICT_COLORS.get(v, "grey"), True)
              for v, g in ok[modelled].groupby("verdict")]
    if (~modelled).any():  # ROCm GPUs, FSDP sized from one process: never recommended, drawn hollow
        groups.append((f"not modelled ({int((~modelled).sum())} offers)", ok[~modelled], "grey", False))
    for label, g, color, filled in groups:
        lo_c, hi_c = g["campaign_cost_usd_low"].astype(float), g["campaign_cost_usd_high"].astype(float)
        lo_h, hi_h = g["work_hours_low"], g["work_hours_high"]
        ax.errorbar(hi_c, hi_h, xerr=[hi_c - lo_c, 0 * hi_c], yerr=[hi_h - lo_h, 0 * hi_h], fmt="o", ms=4,
                    color=color, mfc=color if filled else "white", elinewidth=0.7, alpha=0.85, label=label)
    days = sorted(int(d) for d in plans["days"].unique()) if len(plans) else []
    window_labels = []
    days = [d for d in days if 24 * d > setup_hours]  # a window the setup fills holds no variant
    for d in days:  # every window is drawn: the axis reaches the longest (log scale keeps the points apart)
        ax.axhline(24 * d - setup_hours, linestyle="--", linewidth=0.8, color="grey")  # what is left for variants
        # at the right end: the cheap offers, which the eye looks for, sit at the left
        window_labels.append(ax.annotate(f"{d}-day window", xy=(1.0, 24 * d - setup_hours),
                                         xycoords=("axes fraction", "data"),
                                         xytext=(-4, 2), textcoords="offset points", ha="right", va="bottom",
                                         fontsize=FONT - 2, color="grey"))
    marks = []
    rec = ok[ok["recommended"]] if "recommended" in ok else ok.iloc[0:0]
    if len(rec):
        r = rec.iloc[0]
        ax.scatter([r["campaign_cost_usd_high"]], [r["work_hours_high"]], s=160, facecolors="none",
                   edgecolors="black", linewidths=1.6, label="recommended", zorder=5)
        marks.append((r, "recommended"))
    mine = ok[ok["ordered"]] if "ordered" in ok else ok.iloc[0:0]
    if len(mine) and (not len(rec) or mine.iloc[0]["offer"] != rec.iloc[0]["offer"]):
        r = mine.iloc[0]
        ax.scatter([r["campaign_cost_usd_high"]], [r["work_hours_high"]], s=150, marker="s", facecolors="none",
                   edgecolors="#1f4e9e", linewidths=1.6, label="ordered (--offer)", zorder=5)
        marks.append((r, "ordered"))
    stars = plans[plans["cheapest_for_priority_1"]] if len(plans) else plans
    starred = ok[ok["offer"].isin(set(stars["offer"]))] if len(stars) else ok.iloc[0:0]
    if len(starred):
        ax.scatter(starred["campaign_cost_usd_high"], starred["work_hours_high"], s=150, marker="*",
                   color="#c0392b", label="★ of a window", zorder=6)
        for _, r in starred.iterrows():
            windows = ", ".join(f"{int(d)} d" for d in stars[stars["offer"] == r["offer"]]["days"])
            marks.append((r, f"★ {windows}"))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(float(ok["work_hours_low"].min()) / 1.6,
                max(float(ok["work_hours_high"].max()), 24.0 * (days[-1] if days else 0) - setup_hours) * 1.6)
    ax.xaxis.set_major_formatter(FuncFormatter(_money))
    ax.yaxis.set_major_formatter(FuncFormatter(_hours))
    ax.set_xlabel("campaign cost (slow end; bar: from the fast end)")
    ax.set_ylabel("hours of the variants, setup aside\n(slow end; bar: from the fast end)" if setup_hours else
                  "campaign hours (slow end; bar: from the fast end)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=FONT - 1)
    reasons: dict = {}
    for r, why in marks:  # one name per marked offer, with every reason it is marked
        reasons.setdefault(r["offer"], (r, []))[1].append(why)
    placed = [(r["campaign_cost_usd_high"], r["work_hours_high"], f"{offer} ({'; '.join(why)})")
              for offer, (r, why) in list(reasons.items())[:max_labels]]
    fig.tight_layout()
    _label_points(ax, fig, placed, window_labels, list(zip(ok["campaign_cost_usd_high"], ok["work_hours_high"])))
    setup = (f"the hours its variants run, without the setup ({fmt_hours(setup_hours)} once, the same on every offer, "
             f"included in the cost and in each window's plan)" if setup_hours else "its hours")
    caption = (f"Every offer that fits (or is tight) as a point: the whole campaign's cost against {setup}, at the "
               "slow end of each time range, the bar reaching back to the fast end; hollow: offers whose need leaves "
               "something unmodelled (ROCm GPUs, FSDP sized from one process), never recommended. Ring: the "
               "recommendation; "
               "square: the offer ordered with --offer where it differs; ★: the offer each window's plan marks. "
               f"Dashed lines: the rental windows{', less the setup' if setup_hours else ''}. Labels sit clear of "
               "every point. Basis: each offer's time basis in the selection; prices as of each "
               "offer's date.")
    return fig, caption


def _label_points(ax, fig, points: list[tuple[float, float, str]], obstacles=(), markers=()) -> None:
    """Each label beside its point, inside the plot and clear of every label placed before it, of the window
    labels and of every marker (data coordinates): right of the point, else left, moved up or down in steps until
    it is clear; a moved label gets a leader line to its point."""
    if not points:
        return
    from matplotlib.text import Text
    from matplotlib.transforms import Bbox

    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    placed_boxes = [o.get_window_extent(renderer) for o in obstacles]
    r = 4 * fig.dpi / 72  # a marker's half-width, 4 pt: a label's words never cover an offer's point
    dots = [Bbox([[x - r, y - r], [x + r, y + r]]) for x, y in ax.transData.transform(list(markers)).reshape(-1, 2)]
    step = FONT + 2
    tries = [(side, dy) for k in range(20) for dy in ((0,) if k == 0 else (k * step, -k * step))
             for side in ("right", "left")]
    for x, y, text in sorted(points, key=lambda p: -p[1]):
        for n, (side, dy) in enumerate(tries):
            t = ax.annotate(text, xy=(x, y), xytext=(8 if side == "right" else -8, dy), textcoords="offset points",
                            fontsize=FONT - 2, va="center", ha="left" if side == "right" else "right",
                            annotation_clip=False,
                            bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.85},
                            arrowprops={"arrowstyle": "-", "color": "grey", "lw": 0.6} if dy else None)
            box = t.get_window_extent(renderer)  # the words and their leader line
            words = Text.get_window_extent(t, renderer)
            inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
            clear = not any(box.overlaps(b) for b in placed_boxes) and not any(words.overlaps(d) for d in dots)
            if (inside and clear) or n == len(tries) - 1:
                placed_boxes.append(box)
                break
            t.remove()


def decision_picture(sheet: pd.DataFrame, plans: pd.DataFrame, setup_hours: float = 0.0) -> dict | None:
    made = decision_figure(sheet, plans, setup_hours=setup_hours)
    return None if made is None else {"svg": _svg(made[0]), "caption": made[1]}


# the parts of one variant on a timeline: (name, its hours in the selection row, colour)
TIMELINE_PARTS = (("training", "train_hours_high", "#4c72b0"), ("evaluation", "eval_hours_high", "#dd8452"),
                  ("checkpoint saves", "save_hours", "#8172b3"), ("export", "export_hours", "#c44e52"))
SETUP_COLOR, IDLE_COLOR = "#555555", "#e8e8e8"


def _elapsed(v, _=None) -> str:
    """A tick on a timeline: minutes below two hours, else hours (never two ticks that read the same)."""
    if v <= 0:
        return "0"
    return f"{round(v * 60, 1):g} min" if v < 2 else f"{round(v, 1):g} h"


def timeline_figure(sheet: pd.DataFrame, plans: pd.DataFrame):
    """Each window's plan as a timeline of the offer it marks (★): setup once, then each variant it holds as
    training, evaluation, checkpoint saves and export, then the idle rest of the window; slow end of every range.
    Returns None when no window marks an offer."""
    stars = plans[plans["cheapest_for_priority_1"]] if len(plans) else plans
    if stars.empty:
        return None
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    rows = sheet.drop_duplicates("offer").set_index("offer")
    plt = _plt()
    fig, axes = plt.subplots(len(stars), 1, figsize=(7.4, 1.1 * len(stars) + 0.9), squeeze=False)
    missing: set[str] = set()
    per_variant: dict[str, str] = {}
    for ax, (_, p) in zip(axes[:, 0], stars.iterrows()):
        r = rows.loc[p["offer"]]
        ids = [v for v in str(p["variants_in"] or "").split(", ") if v]
        window = 24.0 * float(p["days"])
        parts = [(name, float(r[col]) if pd.notna(r.get(col)) else 0.0, color) for name, col, color in TIMELINE_PARTS]
        if ids and not parts[3][1]:
            missing.add("export")
        if ids and int(r.get("saves_per_variant") or 0) and not parts[2][1]:
            missing.add("checkpoint saves")
        variant = sum(w for _, w, _ in parts)
        setup = max(0.0, float(p["hours_used_high"]) - variant * len(ids)) if ids else 0.0
        ax.barh(0, setup, left=0.0, color=SETUP_COLOR, height=0.6)
        x, spans = setup, []
        for vid in ids:
            spans.append((vid, x, x + variant))
            for _, width, color in parts:
                ax.barh(0, width, left=x, color=color, height=0.6, edgecolor="white", linewidth=0.3)
                x += width
        # a plan that uses little of its window is drawn zoomed on what it uses: the idle rest is said in words
        shown = window if x >= 0.25 * window or x <= 0 else x * 1.25
        for vid, start, end in spans:
            if (end - start) / shown > 0.08:  # a variant's name only where it has room
                ax.text((start + end) / 2, 0, vid, ha="center", va="center", fontsize=FONT - 2, color="white",
                        clip_on=True)
        ax.barh(0, max(0.0, shown - x), left=x, color=IDLE_COLOR, height=0.6, hatch="//", edgecolor="#bbbbbb",
                linewidth=0)
        if shown < window:
            ax.text(shown, 0, f"idle to {_hours(window)} →", ha="right", va="center", fontsize=FONT - 2,
                    color="#444444")
        if ids and p["offer"] not in per_variant:
            saves = int(r.get("saves_per_variant") or 0)
            per_variant[p["offer"]] = (f"{p['offer']}: each variant {fmt_hours(variant)} = training "
                                       f"{fmt_hours(parts[0][1])}, evaluation {fmt_hours(parts[1][1])}, {saves} "
                                       f"checkpoint save(s) {fmt_hours(parts[2][1])}, export {fmt_hours(parts[3][1])}")
        ax.set_xlim(0, shown)
        ax.set_yticks([])
        ax.xaxis.set_major_locator(MaxNLocator(nbins=7, steps=[1, 2, 2.5, 5, 6, 10]))
        ax.xaxis.set_major_formatter(FuncFormatter(_elapsed))
        out = str(p["variants_out"] or "")
        ax.set_title(f"{int(p['days'])} days · ★ {p['offer']} · {len(ids)} variant(s)"
                     + (f", left out: {out}" if out else "") + f" · idle {_hours(float(p['idle_hours']))}",
                     fontsize=FONT - 1, loc="left")
    handles = [Patch(color=SETUP_COLOR, label="setup (once)")] \
        + [Patch(color=c, label=n) for n, _, c in TIMELINE_PARTS] \
        + [Patch(facecolor=IDLE_COLOR, edgecolor="#bbbbbb", hatch="//", label="idle")]
    fig.legend(handles=handles, loc="lower center", ncol=6, frameon=False, fontsize=FONT - 2)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    said = [f"{name}: missing (not timed by the pilot and no size to model it from), so these plans hold no "
            f"time for it" for name in sorted(missing)]
    caption = ("The plans as timelines: each window's ★ offer, setup once, then each variant it holds (training, "
               "evaluation, checkpoint saves, export), then the idle rest of the window (a plan that uses under a "
               "quarter of its window is drawn zoomed on what it uses); slow end of every time range. "
               + "; ".join(per_variant.values()) + ". Basis: each offer's time, save and export basis in the "
               "selection." +
               (" " + "; ".join(said) + "." if said else ""))
    return fig, caption


def plans_timeline(sheet: pd.DataFrame, plans: pd.DataFrame) -> dict | None:
    made = timeline_figure(sheet, plans)
    return None if made is None else {"svg": _svg(made[0]), "caption": made[1]}


def order_sheet_figures(lines: pd.DataFrame, sheet: pd.DataFrame, plans: pd.DataFrame,
                        headroom: float = 0.10, setup_hours: float = 0.0) -> list[dict]:
    if not available():
        return []
    figs = [decision_picture(sheet, plans, setup_hours), plans_timeline(sheet, plans),
            memory_per_phase(lines, sheet, headroom), cost_per_window(plans), max_micro_batch(sheet)]
    return [f for f in figs if f]


__all__ = ["order_sheet_figures", "available"]
