"""Which ledger lines size a campaign: one stated rule, so that lines about anything else never move a plan.

The rule, for one campaign at one precision (and, for estimates, one kernel target):
1. Family: the campaign's workload, parameters, optimizer and checkpointing, at that precision; one process
   (rank lines stand apart: FSDP rank lines size only FSDP plans); runs whose every phase ended ok.
2. Evidence, best first, never mixed in one fit: measured on a GPU; estimated for the target GPU's kernels;
   measured on a CPU; estimated with CPU kernels. A CPU's kernels are evidence about a GPU only through a
   model (see probes/kernels.py), which is why an estimate for the target outranks a CPU measurement.
3. Uncapped before capped: a cap changes how the allocator behaves (under a cap CUDA's allocator frees its
   cache sooner), so capped runs size a campaign only when there is no uncapped one.
4. The newest run of each shape (micro-batch, seq_len, eval micro-batch, eval seq_len).
5. The NEAREST shapes to the campaign's (log distance in tokens per micro-batch and in seq_len); the
   nearest one with a steady line also gives the time per update.

Facts the pilot writes once per run sit on the phase that measures them (parameters on setup, optimizer
state on first_step, the update's time and census on steady, export time on export): `run_facts` gathers
them per run, so no reader has to know which phase carries what.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from planner.records import OBSERVED_PHASES, PHASES

NEAREST = 8
SHAPE = ["micro_batch", "seq_len", "eval_micro_batch", "eval_seq_len"]
CONFIG = ["workload", "params_json", "precision", "optimizer", "checkpointing", "mode", "device", "device_name",
          "target", "cap", "strategy", "world_size", "grad_accum", "torch_version", "cuda_version", *SHAPE]
FACTS = {"setup": {"param_count": "param_count", "trainable_param_count": "trainable_param_count",
                   "param_bytes": "param_bytes", "position_limit": "position_limit",
                   "position_limit_basis": "position_limit_basis"},
         "first_step": {"optimizer_state_bytes": "optimizer_state_bytes", "flops_per_update": "flops_first_step"},
         "steady": {"update_s": "update_s", "flops_per_update": "flops_per_update",
                    "ops_per_update": "ops_per_update", "op_profile_json": "op_profile_json"},
         "save": {"seconds": "save_s", "checkpoint_bytes": "save_bytes"},
         "export": {"seconds": "export_s", "checkpoint_bytes": "export_bytes"}}


def run_facts(lines: pd.DataFrame) -> pd.DataFrame:
    """One row per run: its configuration, whether every phase (of every rank) ended ok, and the facts the pilot
    wrote on each phase (rank 0's). `newest` orders runs by when they were written."""
    if lines.empty:
        return pd.DataFrame(columns=["run_id", *CONFIG, "complete", "newest", "grad_bytes"]).set_index("run_id")
    order = lines["seq"] if "seq" in lines else pd.Series(range(len(lines)), index=lines.index)
    df = lines.assign(_order=order)
    rank0 = df[df["rank"] == 0] if "rank" in df else df
    base = rank0.groupby("run_id").first()[[c for c in CONFIG if c in df]]
    ok = df.assign(_ok=df["verdict"] == "ok").groupby("run_id").agg(
        _all_ok=("_ok", "all"), newest=("_order", "max"))
    # Complete: every line ok, and every phase its source promises (a probe runs all seven; the user's own loop,
    # seen by a callback or --script, at least setup, first_step, steady and eval).
    source = (df["source"].fillna("").replace("", "probe") if "source" in df
              else pd.Series("probe", index=df.index))
    phases = df.assign(_source=source).groupby("run_id").agg(_phases=("phase", set), _source=("_source", "first"))
    needed = phases["_source"].map(lambda s: set(PHASES) if s == "probe" else set(OBSERVED_PHASES))
    have_all = pd.Series([n <= p for n, p in zip(needed, phases["_phases"])], index=phases.index)
    base["complete"] = ok["_all_ok"] & have_all.reindex(ok.index)
    base["source"] = phases["_source"]
    base["newest"] = ok["newest"]
    for phase, cols in FACTS.items():
        rows = rank0[rank0["phase"] == phase].drop_duplicates("run_id", keep="last").set_index("run_id")
        for src, dst in cols.items():
            base[dst] = rows[src].reindex(base.index) if src in rows else None
    # Ledgers written before the census counted FLOPs on first_step (beside the tracker).
    base["flops_per_update"] = base["flops_per_update"].fillna(base["flops_first_step"])
    params, count, trainable = (pd.to_numeric(base[c], errors="coerce")
                                for c in ("param_bytes", "param_count", "trainable_param_count"))
    # Gradients have their parameters' dtype: the trainable share of the parameter bytes.
    base["grad_bytes"] = (params * trainable / count).where(count > 0)
    return base


def evidence_rank(facts: pd.DataFrame, target: str | None) -> pd.Series:
    """0 measured on a GPU, 1 estimated for the target's kernels, 2 measured on a CPU, 3 estimated with CPU
    kernels (or for no target), 4 estimated for another target's kernels."""
    measured = facts["mode"] == "measured"
    gpu = facts["device"].astype(str).str.startswith("cuda")
    tgt = facts["target"].fillna("") if "target" in facts else pd.Series("", index=facts.index)
    rank = pd.Series(3, index=facts.index)
    rank[~measured & (tgt != "") & (tgt != "cpu")] = 4
    if target:
        rank[~measured & (tgt == target)] = 1
    rank[measured & ~gpu] = 2
    rank[measured & gpu] = 0
    return rank


RANK_NAMES = {0: "measured on a GPU", 1: "estimated for the target's kernels", 2: "measured on a CPU",
              3: "estimated with CPU kernels", 4: "estimated for another GPU class's kernels"}


@dataclass
class Evidence:
    """The lines that size one (campaign, precision, target), and why these."""

    lines: pd.DataFrame  # every line of the chosen runs
    facts: pd.DataFrame  # one row per chosen run, nearest shape first
    rank: int
    capped: bool

    @property
    def run_ids(self) -> list[str]:
        return list(self.facts.index)

    @property
    def nearest(self) -> pd.Series:
        """The chosen run nearest the campaign's shape that has a steady line (times come from it)."""
        return self.facts.iloc[0]

    @property
    def position_limit(self) -> tuple[int | None, str]:
        """The longest sequence the model takes, as its runs' setup lines read it (the smallest if they differ),
        and where that was read; (None, '') when no run states one."""
        if "position_limit" not in self.facts:
            return None, ""
        limits = pd.to_numeric(self.facts["position_limit"], errors="coerce").dropna()
        if limits.empty:
            return None, ""
        run = limits.idxmin()
        return int(limits[run]), str(self.facts.loc[run, "position_limit_basis"] or "")

    def describe(self) -> str:
        cap = "; capped runs (no uncapped run of this family)" if self.capped else ""
        sources = sorted(set(self.facts["source"]) - {"probe"}) if "source" in self.facts else []
        own = f"; the user's own loop ({', '.join(sources)})" if sources else ""
        return f"{RANK_NAMES[self.rank]}: {len(self.facts)} run(s) nearest the campaign's shape{cap}{own}"


def shape_distance(facts: pd.DataFrame, micro_batch: int, seq_len: int) -> pd.Series:
    tokens = facts["micro_batch"].astype(float) * facts["seq_len"].astype(float)
    return ((tokens / (micro_batch * seq_len)).map(math.log2).abs()
            + (facts["seq_len"].astype(float) / seq_len).map(math.log2).abs())


def choose(lines: pd.DataFrame, facts: pd.DataFrame, precision: str, micro_batch: int, seq_len: int,
           target: str | None = None, world_size: int = 1) -> Evidence | None:
    """Apply the rule to one family's lines (already filtered to the campaign's workload, params, optimizer and
    checkpointing); None when no complete run of `world_size` processes at this precision exists (world_size
    > 1: FSDP rank lines, for the per-rank need of FSDP plans)."""
    if facts.empty:
        return None
    runs = facts[(facts["precision"] == precision) & (facts["world_size"] == world_size) & facts["complete"]]
    if world_size > 1:
        runs = runs[runs["strategy"] == "fsdp"]
    if runs.empty:
        return None
    runs = runs.assign(_rank=evidence_rank(runs, target))
    best = int(runs["_rank"].min())
    runs = runs[runs["_rank"] == best]
    uncapped = runs[runs["cap"].fillna("") == ""]
    capped = uncapped.empty
    runs = runs if capped else uncapped
    runs = runs.sort_values("newest").drop_duplicates(SHAPE, keep="last")
    runs = runs.assign(_d=shape_distance(runs, micro_batch, seq_len))
    runs = runs.sort_values(["_d", "newest"], ascending=[True, False]).head(NEAREST)
    chosen = lines[lines["run_id"].isin(runs.index)]
    return Evidence(chosen, runs.drop(columns=["_rank", "_d"]), best, capped)


OWN_LOOP_EVAL = {"script": "call model.eval() for an evaluation pass (model.train() ends it)",
                 "hf-trainer": "give the Trainer an eval_dataset and an evaluation strategy",
                 "lightning": "give the Trainer a validation loop (validation_step and val data)"}


def why_incomplete(lines: pd.DataFrame, shown: int = 3) -> str:
    """Why no single-process run of these lines is complete, run by run (newest first), and what to do: the
    failed lines' verdicts (oom sends you to the oom lines, nothing else does) or the phases a run never wrote."""
    facts = run_facts(lines)
    facts = facts[facts["world_size"].fillna(1) == 1].sort_values("newest", ascending=False)
    reasons, todo = [], []
    for run_id, run in facts.iterrows():
        mine = lines[lines["run_id"] == run_id]
        source = run["source"]
        failed = mine[~mine["verdict"].isin(["ok", "skipped"])]
        if len(failed):
            first = failed.iloc[0]
            reasons.append(f"run {run_id} ({source}): {first['phase']} ended {first['verdict']}")
            todo.append("see `rentplan ledger show --verdict oom` and probe smaller configurations (or a larger --cap)"
                        if first["verdict"] == "oom" else f"see `rentplan ledger show --run {run_id}`")
            continue
        needed = PHASES if source == "probe" else OBSERVED_PHASES
        missing = [p for p in needed if p not in set(mine["phase"])]
        if missing:
            reasons.append(f"run {run_id} ({source}) has no {', '.join(missing)} line")
            if missing == ["eval"] and source in OWN_LOOP_EVAL:
                todo.append(f"plan needs an evaluation from your loop: {OWN_LOOP_EVAL[source]}, then probe again")
            elif source == "probe":
                todo.append("run the same probe again: it resumes configurations that did not finish")
            else:
                todo.append("let your loop run long enough for every phase (its first update, the steady updates, "
                            "one evaluation), then probe again")
    if not reasons:
        return "no single-process run in the ledger for this campaign."
    more = f"; and {len(reasons) - shown} more run(s)" if len(reasons) > shown else ""
    return "; ".join(reasons[:shown]) + more + ". To fix: " + "; ".join(dict.fromkeys(todo[:shown])) + "."
