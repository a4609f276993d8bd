"""Sheets and plans as files: numbers are prepared here, templates (jinja2, StrictUndefined) only loop and print.

Every file is written to a temporary name in the same folder and moved into place with os.replace, so a
crash never leaves a half-written sheet under the real name.
"""

from __future__ import annotations

import json
import math
import os
import shlex
from datetime import datetime, timezone
from pathlib import Path

import jinja2
import pandas as pd

from planner import PACKAGE_DIR, __version__
from planner.catalog_records import Catalog
from planner.decisions.plans import nothing_to_order, ordered, recommend, window_notes
from planner.decisions.select import NO_FIT
from planner.decisions.shapes import input_kind_of
from planner.inputs.campaign_spec import KEPT_CHECKPOINTS, Campaign
from planner.models.memory_model import MB_LIMIT, SEQ_LIMIT
from planner.outputs.figures import available, order_sheet_figures
from planner.outputs.launch import SPEC_NAME, Unmountable, launch_files
from planner.outputs.orders import provenance, stack_for
from planner.outputs.skypilot import order_task
from planner.shapes import dimension_words, size_text
from planner.storage import made_or_nothing, write_all
from planner.units import fmt_bytes, fmt_hours, fmt_seconds, fmt_usd

_ENV: jinja2.Environment | None = None


def template_dir() -> Path:
    """templates/ of the checkout, else the copy shipped inside the installed package."""
    for candidate in (PACKAGE_DIR.parent / "templates", PACKAGE_DIR / "templates"):
        if (candidate / "order_sheet.md.j2").is_file():
            return candidate
    raise FileNotFoundError("rentplan templates not found (reinstall the package)")


def env() -> jinja2.Environment:
    global _ENV
    if _ENV is None:
        _ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(str(template_dir())),
                                  undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                                  autoescape=jinja2.select_autoescape(["html.j2"]))
    return _ENV


def md_text(value) -> str:
    """Text as a markdown sheet prints it: no HTML tag can open (< escaped) and no table cell can break (|
    escaped), on one line."""
    return " ".join(str(value).split()).replace("<", "&lt;").replace("|", "\\|")


def render_template(name: str, context: dict) -> str:
    template = env().get_template(name)
    if name.endswith(".md.j2"):  # every value a markdown sheet prints: escaped for markdown
        return template.render(**_md_context(context))
    return template.render(**context)


def _md_context(obj):
    if isinstance(obj, dict):
        return {k: _md_context(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_md_context(v) for v in obj]
    if isinstance(obj, str):
        return md_text(obj)
    return obj


def sweep_orphans(folder: Path) -> None:
    """Temporary files left by a crash mid-write are removed at the next start."""
    if folder.is_dir():
        for p in folder.glob(".*.tmp"):
            p.unlink(missing_ok=True)


def _num(x, fmt="{:.2f}") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    return fmt.format(x)


def _usd(x) -> str:
    return fmt_usd(x)


def _h2s(hours):
    return None if hours is None or (isinstance(hours, float) and math.isnan(hours)) else hours * 3600


def _range(lo, hi, f) -> str:
    if lo is None or hi is None or (isinstance(lo, float) and math.isnan(lo)):
        return ""
    return f(lo) if f(lo) == f(hi) else f"{f(lo)} – {f(hi)}"


def _price(r) -> str:
    """Per hour for the whole offer; a multi-node offer says what one node costs."""
    nodes = int(r["nodes"])
    each = f" ({nodes} nodes × {_usd(r['price_per_instance_hour_usd'])})" if nodes > 1 else ""
    return _usd(r["price_per_hour_usd"]) + ("/h spot" if r["spot"] else "/h") + each


def capacity(value, extrapolated: bool, at_limit: bool, limit: int) -> str:
    """A max dimension: '≥ 4096 (search limit)' when the search stopped at its limit, '*' when extrapolated."""
    if at_limit:
        return f"≥ {limit:,} (search limit)"
    return f"{value}{'*' if extrapolated else ''}"


def seq_capacity(r) -> str:
    """The max sequence at micro-batch 1, and the model's position limit when that, not memory, bounds it."""
    bound = r.get("max_seq_len_bound")
    if isinstance(bound, str) and bound.startswith("FSDP"):
        return f"≥ {int(r['max_seq_len_at_mb1']):,} ({bound})"
    if isinstance(bound, str) and bound.startswith("the model's"):
        return f"{int(r['max_seq_len_at_mb1']):,} ({bound})"
    return capacity(r["max_seq_len_at_mb1"], r["max_seq_len_extrapolated"], r["max_seq_len_at_mb1"] >= SEQ_LIMIT,
                    SEQ_LIMIT)


def need_text(r) -> str:
    return f"{fmt_bytes(r['need_bytes'])}{'*' if r['need_extrapolated'] else ''}"


def kernels_text(r) -> str:
    """The kernel basis a row was sized from; where its GPU's own basis had no lines, the row says so."""
    basis = r.get("kernel_basis") if isinstance(r.get("kernel_basis"), str) else ""
    note = r.get("kernel_basis_note") if isinstance(r.get("kernel_basis_note"), str) else ""
    return f"{basis} ({note.split(':')[0]})" if note else basis


def time_text(r) -> str:
    """The range, and the point estimate where the model gives one."""
    text = _range(r["update_s_low"], r["update_s_high"], fmt_seconds)
    point = r.get("update_s_point")
    if text and point is not None and not (isinstance(point, float) and math.isnan(point)):
        text += f" (≈ {fmt_seconds(point)})"
    return text


MARKDOWN_ROWS = 12  # offers the markdown sheet lists; it says how many more selection.csv holds
NOT_FITTING_SHOWN = 8


def by_cost(sheet: pd.DataFrame) -> pd.DataFrame:
    """Every offer, cheapest campaign first (offers without a cost last), the verdict a column beside it."""
    return sheet.sort_values(["campaign_cost_usd_high", "price_per_hour_usd", "offer"], na_position="last")


def not_fitting_text(r, catalog: Catalog, headroom: float) -> dict:
    """Why an offer does not fit, on the fit rule's own terms: need + context (+ workspaces) against usable, the
    inequality that really fails (the headroom is the policy on top)."""
    total = float(r["need_bytes"]) + float(r["context_bytes"])
    show = fmt_bytes if fmt_bytes(total) != fmt_bytes(r["usable_bytes"]) else (lambda b: f"{int(b):,} bytes")
    return {"offer": r["offer"], "need": need_text(r), "usable": fmt_bytes(r["usable_bytes"]),
            "why": f"need {show(r['need_bytes'])} + {show(r['context_bytes'])} context and workspaces = "
                   f"{show(total)} > {show(r['usable_bytes'])} usable"}


def margin_text(pct: float) -> str:
    """What is left of the usable memory after need, context and workspaces ('none' when nothing is)."""
    return "none" if pct < 0 else (f"{pct:.1f}%" if pct < 1 else f"{pct:.0f}%")


def sheet_rows(sheet: pd.DataFrame) -> list[dict]:
    out = []
    for _, r in sheet.iterrows():
        out.append({
            "offer": r["offer"], "gpu": r["gpu"], "provider": r["provider"], "gpus": r["gpus_per_instance"],
            "price": _price(r),
            "usable": fmt_bytes(r["usable_bytes"]), "need": need_text(r), "need_phase": r["need_phase"],
            "kernels": kernels_text(r), "kernel_basis": r.get("kernel_basis") or "",
            "kernel_note": r.get("kernel_basis_note") if isinstance(r.get("kernel_basis_note"), str) else "",
            "headroom": margin_text(r["headroom_pct"]), "verdict": r["verdict"],
            "unmodelled": r["unmodelled"] if isinstance(r.get("unmodelled"), str) else "",
            "max_mb": (f"≥ {int(r['max_micro_batch'])} (FSDP: the planned micro-batch; larger not searched)"
                       if r.get("strategy") == "fsdp" else
                       capacity(r["max_micro_batch"], r["max_micro_batch_extrapolated"],
                                r["max_micro_batch"] >= MB_LIMIT, MB_LIMIT)),
            "max_seq": seq_capacity(r),
            "precision": r["precision"], "mb": r["micro_batch"], "accum": r["grad_accum"], "replicas": r["replicas"],
            "strategy": r["strategy_label"], "strategy_why": r["strategy_why"],
            "update_time": time_text(r),
            "per_variant": _range(_h2s(r["variant_hours_low"]), _h2s(r["variant_hours_high"]), fmt_seconds),
            "hours": _range(r["campaign_hours_low"], r["campaign_hours_high"], fmt_hours),
            "cost": _range(r["campaign_cost_usd_low"], r["campaign_cost_usd_high"], _usd),
            "as_of": r["as_of"], "notes": r["notes"],
        })
    return out


def plan_rows(plans: pd.DataFrame, sheet: pd.DataFrame | None = None, limit_per_window: int = 5) -> list[dict]:
    """Each window's first rows (the ★ first), those that hold some work only, and always the ordered and the
    recommended offer's row, so the table shows what the sheet compares."""
    out: list[dict] = []
    if plans.empty:
        return out
    keep = set()
    if sheet is not None:
        keep = set(sheet.loc[sheet.get("ordered", sheet["recommended"]) | sheet["recommended"], "offer"])
    for d, g in plans.groupby("days", sort=True):
        busy = g[g["variants_in"].fillna("") != ""]
        shown = pd.concat([busy.head(limit_per_window), busy[busy["offer"].isin(keep)]]).drop_duplicates("offer")
        for _, r in shown.iterrows():
            out.append({
                "days": int(d), "offer": r["offer"], "gpu": r["gpu"], "strategy": r["strategy_label"],
                "marked": "★" if r["cheapest_for_priority_1"] else "",
                "variants_in": r["variants_in"] or "—", "variants_out": r["variants_out"] or "—",
                "hours": _range(r["hours_used_low"], r["hours_used_high"], fmt_hours),
                "idle": f"{r['idle_hours']:.1f}", "cost": _range(r["cost_usd_low"], r["cost_usd_high"], _usd),
                "held": _usd(r["cost_if_held_whole_window_usd"]),
            })
    return out


def hours_by_kind(r) -> str:
    """Every billed hour of a variant, each with its basis: training, evaluation, checkpoint saves, export."""
    saves = int(r["saves_per_variant"]) if pd.notna(r.get("saves_per_variant")) else 0
    save_each = fmt_seconds(r["save_s"]) if pd.notna(r.get("save_s")) else "not sized"
    export = fmt_seconds(r["export_s"]) if pd.notna(r.get("export_s")) else "not sized"
    eval_basis = f" ({r['eval_basis']})" if isinstance(r.get("eval_basis"), str) else ""
    return (f"training {_range(_h2s(r['train_hours_low']), _h2s(r['train_hours_high']), fmt_seconds)}; evaluation "
            f"{_range(_h2s(r['eval_hours_low']), _h2s(r['eval_hours_high']), fmt_seconds)}{eval_basis}; "
            f"{saves} checkpoint "
            f"save(s) of {save_each} each ({r['save_basis']}); export {export} ({r['export_basis']})")


def order_context(rec: pd.Series, sheet: pd.DataFrame, lines: pd.DataFrame) -> dict:
    """'Rent this': the ordered offer, who chose it, and the recommendation beside it when they differ."""
    row = sheet_rows(sheet.loc[[rec.name]])[0]
    best = recommend(sheet)
    if sheet.attrs.get("ordered_by", "").startswith("you"):
        chosen = "you chose it (--offer)" + (
            "; it is also rentplan's recommendation" if best is not None and best["offer"] == rec["offer"] else
            f"; rentplan recommends {best['offer']} ({best['gpu']}, "
            f"{_range(best['campaign_cost_usd_low'], best['campaign_cost_usd_high'], _usd)})"
            if best is not None else "; rentplan recommends none")
    else:
        chosen = "rentplan's recommendation: " + ("the cheapest fully modelled offer that fits, no GPU idle"
                                                  if not rec["unmodelled"] else "the cheapest that fits")
    return {
        "offer": rec["offer"], "gpu": rec["gpu"], "provider": rec["provider"],
        "instance": rec["instance"] if isinstance(rec["instance"], str) else "",
        "gpus": int(rec["gpus_per_instance"]), "price": _price(rec), "strategy_why": rec["strategy_why"],
        "chosen": chosen, "unmodelled": rec["unmodelled"] or "",
        "usable": fmt_bytes(rec["usable_bytes"]), "need": row["need"],
        "need_phase": rec["need_phase"], "need_basis": rec["need_basis"], "headroom": margin_text(rec["headroom_pct"]),
        "max_mb": row["max_mb"], "max_seq": row["max_seq"], "precision": rec["precision"],
        "mb": int(rec["micro_batch"]), "accum": int(rec["grad_accum"]), "replicas": int(rec["replicas"]),
        "examples_per_update": int(rec["examples_per_update"]), "strategy": rec["strategy_label"],
        "verdict": rec["verdict"], "update_time": row["update_time"],
        "time_basis": rec["time_basis"],
        "per_variant": _range(_h2s(rec["variant_hours_low"]), _h2s(rec["variant_hours_high"]), fmt_seconds),
        "hours_by_kind": hours_by_kind(rec),
        "hours": _range(rec["campaign_hours_low"], rec["campaign_hours_high"], fmt_hours),
        "cost": _range(rec["campaign_cost_usd_low"], rec["campaign_cost_usd_high"], _usd),
        "as_of": rec["as_of"], "price_source": rec["price_source"], "notes": rec["notes"] or "—",
        "stack": stack_for(rec, lines), "unverified": rec["unverified"] or "none",
        "context_basis": rec["context_basis"], "evidence": rec["evidence"], "run_ids": rec["run_ids"],
    }


def build_context(campaign: Campaign, sheet: pd.DataFrame, plans: pd.DataFrame, budget: dict,
                  lines: pd.DataFrame, catalog: Catalog, headroom: float) -> dict:
    rec = ordered(sheet) if "ordered" in sheet else recommend(sheet)
    fitting = sheet[sheet["verdict"] != NO_FIT]
    prov = provenance(lines)
    kind = input_kind_of(sheet)
    seq = int(sheet["seq_len"].iloc[0]) if len(sheet) else None
    modes = sorted({p["mode"] for p in prov})
    return {
        "version": __version__,
        "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "campaign": {"name": campaign.name, "workload": campaign.workload, "params": campaign.params_json,
                     "effective_batch": campaign.effective_batch, "updates": campaign.updates,
                     "variants": [{"id": v.id, "lr": v.lr, "priority": v.priority} for v in campaign.variants],
                     "eval": f"every {campaign.eval.every_updates} updates, {campaign.eval.examples} examples at "
                             f"{size_text(kind, campaign.eval.seq_len)}",
                     "saves": f"a checkpoint every {campaign.save_every} updates ("
                              + ("save_every_updates" if campaign.save_every_updates
                                 else "at each evaluation: the default")
                              + f"), the newest {KEPT_CHECKPOINTS} kept per run",
                     "export": campaign.export, "setup_hours": campaign.setup_hours,
                     "seq_len": seq, "precision": campaign.precision,
                     # one campaign's size in its model's words: seq_len for a sequence, positions for an image
                     "shape": sheet.attrs.get("shape_text") or f"seq_len {seq} ({sheet.attrs.get('seq_len_note', '')})",
                     "at": size_text(kind, seq) if seq else "", "dims": dimension_words(kind),
                     "base": base_note(campaign.params)},
        "assumptions": [
            f"fit: (need + {fmt_bytes(catalog.context_bytes)} CUDA context + BLAS workspaces not in the lines' "
            f"peaks, + "
            f"NCCL buffers on several GPUs) × (1 + {headroom:.0%} headroom) ≤ usable memory; 'tight': that total "
            f"fits the usable memory but not with the headroom; 'does not fit': the total alone is above the usable "
            f"memory (each row's context basis names what was added)",
            f"need = the largest phase peak: reserved where measured on CUDA, else the reserved peak a model of "
            f"CUDA's caching allocator gives for the run's own allocations, else (lines without that model) "
            f"allocated × {catalog.fragmentation_factor:g}; allocated and reserved are never added",
            "lines that size the campaign: one rule (each GPU from the lines of the kernels it dispatches, its "
            "'kernels' column: measured on that GPU kind > measured on a GPU of its basis > estimated for its basis; "
            "only where its basis has no lines, the nearest that has (the other GPU basis, then the CPU's), said on "
            "the row; uncapped; newest per shape; nearest shapes); the runs used are named under 'Rent this'",
            "time ranges: see each row's basis; plans and costs use the slow end of the range",
            f"checkpoint saves and the export: timed on a GPU of the same kind where the ledger has it, else the bytes "
            f"the pilot wrote ÷ the offer's disk write rate (catalog default {catalog.disk_write_mib_s:g} MiB/s, "
            f"assumed); a CPU's write time is never used for a GPU",
            "recommendation and each window's ★: one rule: ROCm GPUs are listed but not sized (never recommended), "
            "then fully modelled offers before those whose need leaves something out, fits before tight, no idle "
            "GPU before idle ones, then the cheapest (the whole campaign for the recommendation, the window for ★)",
            "* after a need, a max micro-batch or a sequence length: extrapolated beyond the probed range; "
            "'≥ N (search limit)': the search stopped at its limit, the GPU holds at least that",
            "≈ after a time range: the point estimate inside it",
        ] + (["estimated lines run under fake tensors with the kernels of their target (flash or memory-"
              "efficient attention, fused dropout, CUDA's autocast policy); an estimate with CPU kernels says so in "
              "its need basis"] if "estimated" in modes else []),
        "recommended": None if rec is None else order_context(rec, sheet, lines),
        "order_for_this_machine": bool(sheet.attrs.get("order_for_this_machine")),
        "nothing_to_order": nothing_to_order(sheet) if rec is None else "",
        "window_notes": window_notes(plans, sheet),
        "rows": sheet_rows(fitting.head(MARKDOWN_ROWS)),  # the markdown sheet's; selection.csv holds them all
        "all_rows": sheet_rows(by_cost(sheet)),  # the HTML sheet's: every offer, cheapest first, filterable
        "n_fitting": int(len(fitting)), "n_offers": int(len(sheet)), "n_more": max(0, len(fitting) - MARKDOWN_ROWS),
        "dearer_offers": int(sheet.attrs.get("dearer_offers", 0)),
        "n_tight": int((sheet["verdict"] == "tight").sum()),
        "not_fitting": [not_fitting_text(r, catalog, headroom)
                        for _, r in sheet[sheet["verdict"] == NO_FIT].head(NOT_FITTING_SHOWN).iterrows()],
        "n_not_fitting_more": max(0, int((sheet["verdict"] == NO_FIT).sum()) - NOT_FITTING_SHOWN),
        "plans": plan_rows(plans, sheet),
        "budget": budget_context(budget),
        "provenance": prov,
        "catalog": {"source": catalog.source},
    }


def budget_context(budget: dict) -> dict:
    return {
        "recommended": budget["recommended"] or "none",
        "ordered": budget.get("ordered") or "none",
        "per_variant": [{"variant": v["variant"], "priority": v["priority"],
                         **{k: _range(v[f"{k}_hours_low"], v[f"{k}_hours_high"], fmt_hours)
                            for k in ("train", "eval", "save", "export")},
                         "hours": _range(v["hours_low"], v["hours_high"], fmt_hours),
                         "cost": _range(v["cost_usd_low"], v["cost_usd_high"], _usd)} for v in budget["per_variant"]],
        "per_plan": [{"days": int(p["days"]), "offer": p["offer"], "variants_in": p["variants_in"] or "—",
                      "variants_out": p["variants_out"] or "—", "cost": _usd(p["cost_usd_high"]),
                      "idle": f"{p['idle_hours']:.1f}"} for p in budget["per_plan"]],
        "per_offer": [{"offer": o["offer"], "gpu": o["gpu"], "hours": _num(o["campaign_hours_high"]),
                       "cost": _range(o["campaign_cost_usd_low"], o["campaign_cost_usd_high"], _usd)}
                      for o in budget["per_offer"]],
        "cap": None if not budget["budget"] else {
            "cap": _usd(budget["budget"]["cap_usd"]), "cost": _usd(budget["budget"]["ordered_cost_usd_high"]),
            "within": budget["budget"]["within"], "margin": _usd(abs(budget["budget"]["margin_usd"])),
            "offers_within": budget["budget"]["offers_within_cap"]},
    }


def base_note(params: dict) -> str:
    """What the base model's weights are, when they are not the precision's own dtype (QLoRA)."""
    kind = params.get("quantize")
    if not kind:
        return ""
    bits = "8-bit int8 rows with a scale per row" if kind == "int8" else \
        f"4-bit {kind} (two per byte, an absmax per 64, itself 8-bit per 256: bitsandbytes' double quantization)"
    return (f"base weights quantized: the linear layers in {bits}, the rest in bf16; only the LoRA adapter "
            "trains (QLoRA)")


def write_outputs(out: Path, campaign: Campaign, sheet: pd.DataFrame, plans: pd.DataFrame, budget: dict,
                  lines: pd.DataFrame, catalog: Catalog, headroom: float, order: dict | None,
                  spec_path: str | None = None, dearer: pd.DataFrame | None = None, on_note=None) -> list[Path]:
    """Every file of a plan. dearer: the offers left out of the sheet (a cheaper one of their market is in it),
    written to selection-all.csv with the sheet's rows when given (`plan --all-offers`), else that file goes.
    on_note(text): told what the files cannot do (no sky.yaml, and why)."""
    sweep_orphans(out)
    launch, verify_path, launch_note = order_files(order, lines, out, spec_path, len(campaign.variants))
    if launch_note and on_note:
        on_note(launch_note)
    ctx = build_context(campaign, sheet, plans, budget, lines, catalog, headroom)
    ctx["verify_command"] = f"rentplan verify {shlex.quote(verify_path)}"  # as sky.yaml's run line says it
    ctx["launch_note"] = launch_note
    ctx["figures"] = order_sheet_figures(lines, sheet, plans, headroom, campaign.setup_hours)
    ctx["figures_note"] = ("" if available()
                           else "No pictures: install the report extra (pip install 'rentplan[report]').")
    files = {
        "selection.csv": sheet.to_csv(index=False),
        "selection-all.csv": None if dearer is None else pd.concat([sheet, dearer]).to_csv(index=False),
        "plans.csv": plans.to_csv(index=False),
        "order_sheet.md": render_template("order_sheet.md.j2", ctx),
        "order_sheet.html": render_template("order_sheet.html.j2", ctx),
        "budget.md": render_template("budget.md.j2", ctx),
    }
    files.update(launch)
    with made_or_nothing(out):  # None: a launch file of an earlier plan that this decision has none of goes
        write_all({out / name: text for name, text in files.items()})
        written = [out / name for name, text in files.items() if text is not None]
    return written


LAUNCH_FILES = ("order.json", "sky.yaml", "order-campaign.yaml")


def order_files(order: dict | None, lines: pd.DataFrame, out: Path, spec_path: str | None,
                runs: int) -> tuple[dict, str, str]:
    """order.json and, for an offer on a CUDA GPU, what launches it (sky.yaml and the campaign as ordered, every
    path as the rented machine reads it: planner/outputs/launch.py), and the path `rentplan verify` is given there
    (sky.yaml's, else order.json's from the folder plan ran in). A file this decision has none of maps to None, so
    an earlier plan's copy does not stay beside this order. The third item says why sky.yaml was left out ("" when
    it was not): a file it would carry has a name SkyPilot cannot (planner/outputs/launch.Unmountable); the order
    and the sheets are written all the same."""
    files: dict = dict.fromkeys(LAUNCH_FILES)
    verify_path = os.path.relpath(out / "order.json") if out.resolve().is_relative_to(Path.cwd().resolve()) \
        else str((out / "order.json").resolve())
    note = ""
    if order is None:
        return files, verify_path, note
    if spec_path is not None and order["offer"]["id"] != "local" and order["expect"]["device_kind"] == "cuda":
        try:
            launch = launch_files(order, spec_path, str(out))
            sky = order_task(launch.order, launch, lines, runs)
        except Unmountable as e:
            note = (f"no sky.yaml: {e}. The sheet, plans and order.json are written; launch the order your own "
                    "way, or fix the name and plan again.")
        else:
            order, verify_path = launch.order, launch.order_path
            files["sky.yaml"], files[SPEC_NAME] = sky, launch.spec_text
    files["order.json"] = json.dumps(_no_nan(order), indent=2, default=_json_default, allow_nan=False)
    return files, verify_path, note


def _no_nan(obj):
    """Strict JSON: an unknown number is null, never NaN."""
    if isinstance(obj, dict):
        return {k: _no_nan(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_no_nan(v) for v in obj]
    if isinstance(obj, float) and math.isnan(obj):
        return None
    return obj


def _json_default(x):
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, float) and math.isnan(x):
        return None
    return str(x)
