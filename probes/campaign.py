"""Run the campaign itself, on the same Trainer the pilot measured: every variant (and seed) keeps the
control's architecture, data, effective batch and update budget; only the declared variable differs.

Per update: loss and learning rate; per validation point: mean loss (and accuracy where the workload can
predict); stop rules declared in the spec (non-finite loss, divergence threshold). Every run has an id,
its events are appended (started, evaluated, finished | diverged | error | interrupted), nothing is edited.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd
import torch

from planner.errors import CampaignError, sigterm_as_interrupt
from planner.inputs.campaign_spec import (
    KEPT_CHECKPOINTS,
    Campaign,
    CampaignRun,
    RunVariant,
    StopRules,
    Variant,
    campaign_run,
)
from planner.ledger import Ledger, LedgerFull, holding, new_id
from planner.records import ProbeConfig
from planner.storage import advice, made_or_nothing, storage_problem
from planner.tools.archive import sha256
from probes import checkpoint
from probes.distributed import barrier, from_rank0, summed, world_of
from probes.loop import NonFinite, Trainer
from probes.pilot import environment, last_line
from probes.workloads import load_workload, local_modules

CONTROL_EXAMPLES = 4
PREDICTIONS_KEPT = 32  # (prediction, target) pairs kept per validation point: enough to read, bounded


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def code_revision(source: str | Path | None = None) -> str:
    """The revision of the workload's own folder: its git commit (with -dirty when it has changes), else the
    sha256 of the workload's source file, else 'builtin' for rentplan's own workloads."""
    if source is None:
        return "builtin (rentplan " + _own_version() + ")"
    src = Path(source).resolve()  # as local_modules names the files: `rentplan-out/../wl.py` is `wl.py`
    folder = src if src.is_dir() else src.parent
    where = f"no git repository at {folder}"
    try:
        rev = subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        if rev.returncode == 0:
            dirty = subprocess.run(["git", "-C", str(folder), "status", "--porcelain", "--", "."],
                                   capture_output=True, text=True, timeout=10)
            return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
        # HEAD names no commit, but the folder may still be a repository: `git init` before the first commit
        inside = subprocess.run(["git", "-C", str(folder), "rev-parse", "--is-inside-work-tree"],
                                capture_output=True, text=True, timeout=10)
        if inside.returncode == 0 and inside.stdout.strip() == "true":
            where = f"no commits yet in the git repository at {folder}"
    except (OSError, subprocess.SubprocessError):
        pass
    if src.is_file():
        files = local_modules(src) if src.suffix == ".py" else [src]
        if len(files) == 1:
            return f"sha256:{sha256(src)} ({where})"
        names = [f.relative_to(folder).as_posix() for f in files]
        # one hash over every module the workload imports from its folder: a change to any of them shows
        h = hashlib.sha256("".join(f"{n}\0{sha256(f)}\n" for n, f in sorted(zip(names, files))).encode())
        return (f"sha256:{h.hexdigest()} over {len(files)} files: {', '.join(names[:8])}"
                f"{', ...' if len(names) > 8 else ''} (sha256 of each 'path NUL sha256' line, by path; {where})")
    return f"unknown ({src} is neither a git checkout nor a file)"


def _own_version() -> str:
    from planner import __version__

    return __version__


def workload_source(ref: str) -> Path | None:
    """The file a workload reference loads: file.py:fn, a module's file, or hf:'s config.json; None for built-ins."""
    if ref.startswith("builtin:"):
        return None
    if ref.startswith("hf:"):
        p = Path(ref[3:])
        return p / "config.json" if p.is_dir() else p
    target = ref.rsplit(":", 1)[0]
    if target.endswith(".py") or "/" in target:
        return Path(target)
    import importlib.util

    try:
        found = importlib.util.find_spec(target)
    except (ImportError, ValueError):
        return None
    return Path(found.origin) if found is not None and found.origin else None


def variant_config(run: CampaignRun, variant: RunVariant, device: str, world: int = 1,
                   strategy: str = "single") -> ProbeConfig:
    """The variant's configuration: its own micro-batch (accumulation rises to hold the effective batch),
    checkpointing and precision where it sets them, the campaign's otherwise. With `world` data-parallel
    processes each takes effective_batch / world examples per update."""
    if run.effective_batch % world:
        raise ValueError(f"effective_batch {run.effective_batch} does not split over {world} processes")
    per_rank = run.effective_batch // world
    mb = variant.micro_batch or max(d for d in range(1, min(8, per_rank) + 1) if per_rank % d == 0)
    if per_rank % mb:
        raise ValueError(f"micro_batch {mb} does not divide the {per_rank} examples per process and update")
    return ProbeConfig(workload=run.workload, params_json=json.dumps(run.params, sort_keys=True),
                       micro_batch=mb, seq_len=run.seq_len, eval_seq_len=run.eval.seq_len,
                       eval_micro_batch=run.eval.micro_batch or mb, grad_accum=per_rank // mb,
                       precision=variant.precision, checkpointing=variant.checkpointing,
                       optimizer=run.optimizer, lr=variant.lr, device=device,
                       strategy=strategy if world > 1 else "single", world_size=world)


def evaluate(trainer: Trainer, run: CampaignRun) -> tuple[float, float | None, list[dict]]:
    """Mean validation loss over the campaign's eval examples, accuracy when predict() exists, and the first
    PREDICTIONS_KEPT (item, prediction, target) triples of the pass. Data-parallel: each process evaluates its
    share (Trainer.batch reads by rank) and the sums are taken over the processes."""
    ev = run.eval
    mb = ev.micro_batch or trainer.cfg.micro_batch
    out = trainer.evaluate(mb, ev.seq_len, batches=max(1, ev.examples // (mb * trainer.world)),
                           predictions=PREDICTIONS_KEPT)
    loss_sum, n, right, total = summed([out.loss_sum, out.batches, out.right, out.total], trainer.device)
    kept = [{"item": f"val batch {i} #{k}", "prediction": str(p), "target": str(t)} for i, k, p, t in out.kept]
    return loss_sum / n, (right / total if total else None), kept


def control_outputs(trainer: Trainer) -> dict:
    """Outputs on fixed control inputs (no autocast), recorded at export and compared by `finish`."""
    out = trainer.evaluate(CONTROL_EXAMPLES, trainer.cfg.seq_len, split="control", predictions=sys.maxsize, amp=False)
    result = {"loss": out.loss}
    if out.total:
        result["pred"] = [p for _, _, p, _ in out.kept]
    return result


def clock(dev: torch.device) -> float:
    """perf_counter once the device's queued work is done: GPU work is asynchronous, so without the synchronize an
    update's kernels would be timed into the next update (or an eval) instead of its own."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()


def release(device: str) -> None:
    """Between runs: what the last run left (its model, optimizer and cached blocks, an OOM's or an error's
    included) is freed, so the next run starts from an empty allocator rather than the last one's leftovers."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def device_start_up(device: str) -> float:
    """Seconds to make the device ready (context, first kernels, allocator): paid once per `campaign run`,
    reported on its own and billed to no variant."""
    t0 = time.perf_counter()
    dev = torch.device(device)
    x = torch.ones(256, 256, device=dev)
    float((x @ x).sum())
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0


def snapshot_inputs(run: CampaignRun, cfg: ProbeConfig, run_dir: Path) -> dict:
    """Copy the spec and the workload's source into the run's folder as they are now (the archive ships these
    copies, not whatever the files hold later); return their names and sha256."""
    kept = {}
    spec = Path(run.source)
    if spec.is_file():
        (run_dir / "spec").mkdir(exist_ok=True)
        shutil.copy2(spec, run_dir / "spec" / spec.name)
        kept["spec"] = {"file": f"spec/{spec.name}", "sha256": sha256(spec)}
    src = workload_source(cfg.workload)
    if src is not None and src.is_file():
        (run_dir / "workload").mkdir(exist_ok=True)
        shutil.copy2(src, run_dir / "workload" / src.name)
        kept["workload"] = {"file": f"workload/{src.name}", "sha256": sha256(src)}
        if src.suffix == ".py":  # the modules it imports from its folder, at their paths beside it
            folder = src.resolve().parent
            for f in local_modules(src)[1:]:
                rel = f.relative_to(folder)
                (run_dir / "workload" / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, run_dir / "workload" / rel)
                kept["workload"].setdefault("modules", {})[f"workload/{rel.as_posix()}"] = sha256(f)
    return kept


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the stop rules say after one update: a divergence first seen at it (why), a stop (why), and the
    run's outcome when it ends here (None: it goes on)."""
    diverged: str | None = None
    stopped: str | None = None
    outcome: str | None = None


def stop_rule(loss: float, first_loss: float | None, diverged_before: bool, rules: StopRules) -> Verdict:
    """Divergence (non-finite, or above diverge_above × the run's first loss) is judged on every update whatever
    the stop rules say; stop_if.diverged decides whether it ends the run, stop_if.loss_above stops it. Pure."""
    why = None
    if not math.isfinite(loss):
        why = "non-finite loss"
    elif (first_loss is not None and math.isfinite(first_loss) and first_loss > 0
          and loss > rules.diverge_above * first_loss):
        why = f"loss {loss:.4g} above {rules.diverge_above:g} × the first loss {first_loss:.4g}"
    diverged = why if why and not diverged_before else None
    if diverged and rules.on_divergence:
        return Verdict(diverged=diverged, outcome="diverged")
    if rules.loss_above is not None and loss > rules.loss_above:
        return Verdict(diverged=diverged, stopped=f"loss {loss:.4g} above stop_if.loss_above {rules.loss_above}",
                       outcome="diverged" if diverged_before or diverged else "stopped")
    return Verdict(diverged=diverged)


@dataclasses.dataclass(frozen=True)
class OpenRun:
    """A run as it starts: its id, configuration and folder (made, with the inputs as they are now, by rank 0)."""
    run: CampaignRun
    variant: RunVariant
    seed: int
    run_id: str
    cfg: ProbeConfig
    dev: torch.device
    run_dir: Path
    updates: int
    rank: int
    world: int
    inputs: dict


def open_run(run: CampaignRun, variant: RunVariant, seed: int, out_dir: str, device: str, updates: int | None,
             strategy: str) -> OpenRun:
    rank, world = world_of()
    run_id = from_rank0(new_id("c"))
    cfg = variant_config(run, variant, device, world, strategy)
    run_dir = Path(out_dir) / run_id
    inputs = {}
    if rank == 0:
        with made_or_nothing(run_dir):  # a disk that fills here leaves no half-made folder (the run's, or --out's)
            run_dir.mkdir(parents=True)
            inputs = snapshot_inputs(run, cfg, run_dir)
    return OpenRun(run, variant, seed, run_id, cfg, torch.device(device), run_dir, updates or run.updates, rank,
                   world, inputs)


class RunLog:
    """The run's rows (rank 0 into the ledger, other ranks to stderr: _OtherRank) and its progress lines."""

    def __init__(self, led, opened: OpenRun, progress):
        self.led, self.run_id = led, opened.run_id
        self.prefix = f"{opened.variant.id} seed {opened.seed}: "
        self.progress = progress if opened.rank == 0 else _quiet

    @classmethod
    @contextlib.contextmanager
    def open(cls, ledger_path: str, opened: OpenRun, progress, start_up_s: float | None):
        """The run's row (its configuration and what it was asked), then its log."""
        run, variant, cfg = opened.run, opened.variant, opened.cfg
        env = environment(opened.dev)
        with (Ledger(ledger_path) if opened.rank == 0 else _OtherRank(opened.rank, opened.run_id)) as led:
            led.add("campaign_runs", {
                "run_id": opened.run_id, "campaign": run.name, "variant": variant.id, "seed": opened.seed,
                "lr": variant.lr, "config_json": json.dumps({
                    "campaign": run.source, "config": dataclasses.asdict(cfg), "updates": opened.updates,
                    "planned_updates": run.updates, "effective_batch": run.effective_batch, "control": run.control,
                    "changes": variant.changes, "inputs": opened.inputs, "quality_target": run.quality_target,
                    "diverge_above": run.rules.diverge_above, "stop_if": run.stop_if,
                    "device_start_up_s": start_up_s}),
                "device": env["device"], "device_name": env["device_name"], "torch_version": env["torch_version"],
                "code_revision": code_revision(workload_source(cfg.workload)), "started_at": _now()})
            yield cls(led, opened, progress)

    def say(self, msg: str) -> None:
        self.progress(self.prefix + msg)

    def event(self, name: str, update: int, detail: str = "") -> None:
        self.led.add("campaign_events", {"run_id": self.run_id, "event": name, "update_no": update, "detail": detail,
                                         "at": _now()})

    def metric(self, kind: str, update: int, seconds: float, loss=None, lr=None, accuracy=None) -> None:
        self.led.add("campaign_metrics", {"run_id": self.run_id, "update_no": update, "kind": kind, "loss": loss,
                                          "lr": lr, "accuracy": accuracy, "seconds": seconds, "at": _now()})

    def predictions(self, update: int, kept: list[dict]) -> None:
        for k in kept:
            self.led.add("campaign_predictions", {"run_id": self.run_id, "update_no": update, **k})


def run_variant(run: CampaignRun, variant: RunVariant, seed: int, ledger_path: str, out_dir: str,
                device: str = "cpu", updates: int | None = None, progress=print,
                start_up_s: float | None = None, strategy: str = "single") -> tuple[str, str]:
    """Train one variant with one seed; returns (run id, outcome: finished | diverged | stopped | error).
    Lines go to the ledger as they happen; stop_rule judges every update.

    Under torchrun (a process group started, probes/distributed.init_from_env) every process trains its share
    of each update with `strategy` (ddp | fsdp); losses are averaged over the processes, so every process takes
    the same decisions; only rank 0 writes the ledger, the run folder and the export."""
    opened = open_run(run, variant, seed, out_dir, device, updates, strategy)
    with RunLog.open(ledger_path, opened, progress, start_up_s) as log:
        log.event("started", 0)
        torch.manual_seed(seed)
        built: list[Trainer] = []  # the trainer once made: where an interrupt says the run stopped
        try:
            return opened.run_id, train_loop(opened, log, ledger_path, out_dir, built)
        except KeyboardInterrupt:
            log.event("interrupted", built[0].update if built else 0, "interrupted (Ctrl-C or SIGTERM); the same "
                      "command again resumes it from its newest checkpoint")
            raise
        except LedgerFull:  # nothing more can be written: said by the command, the run stays as far as it got
            raise
        except Exception as e:  # noqa: BLE001  the run stays in the ledger, marked
            log.event("error", 0, last_line(e))
            log.say(f"error: {last_line(e)}")
            return opened.run_id, "error"


def train_loop(opened: OpenRun, log: RunLog, ledger_path: str, out_dir: str, built: list) -> str:
    """Set up (resuming an interrupted attempt), train `updates` updates with evaluations and saves, export;
    returns the outcome (finished | diverged | stopped)."""
    run, cfg, dev, run_dir, updates = opened.run, opened.cfg, opened.dev, opened.run_dir, opened.updates
    t_setup = clock(dev)
    trainer = Trainer(load_workload(cfg.workload, json.loads(cfg.params_json)), cfg, dev)
    built.append(trainer)
    for note in data_notes(trainer.workload, cfg):
        log.event("data", 0, note)
        log.say(f"data: {note}")
    log.metric("setup", 0, clock(dev) - t_setup)
    first_loss, diverged_at = None, None
    earlier = interrupted_run(ledger_path, opened.run_id, run.name, opened.variant.id, opened.seed, cfg, updates,
                              out_dir) if opened.world == 1 else None  # ranks' shards resume through DCP: not yet
    if earlier:
        old_run, path, first_loss = earlier
        checkpoint.load(trainer, str(path))
        log.event("resumed", trainer.update, f"from {old_run}/{path.name}: that run was interrupted")
        log.say(f"resumed from {old_run}/{path.name} (update {trainer.update})")
    for _ in range(updates - trainer.update):
        t0 = clock(dev)
        try:
            res = trainer.train_update()
        except NonFinite as e:
            log.event("diverged", e.update, f"{e} (a non-finite loss always ends the run)")
            log.say(f"diverged at update {e.update} (non-finite)")
            return "diverged"
        u = trainer.update
        if opened.world > 1:  # the update's loss over every process's share: one decision everywhere
            res = dataclasses.replace(res, loss=summed([res.loss], dev)[0] / opened.world)
        log.metric("train", u, clock(dev) - t0, res.loss, trainer.lr())
        first_loss = res.loss if first_loss is None else first_loss
        verdict = stop_rule(res.loss, first_loss, diverged_at is not None, run.rules)
        if verdict.diverged:
            diverged_at = u
            log.event("diverged", u, verdict.diverged + ("" if run.rules.on_divergence else
                                                         "; stop_if.diverged is false: it runs on"))
            log.say(f"diverged at update {u}: {verdict.diverged}")
        if verdict.stopped:
            log.event("stopped", u, verdict.stopped)
            log.say(f"stopped at update {u} (loss above {run.rules.loss_above})")
        if verdict.outcome:
            return verdict.outcome
        if u % run.eval.every_updates == 0 or u == updates:
            t1 = clock(dev)
            loss, acc, kept = evaluate(trainer, run)
            log.metric("val", u, clock(dev) - t1, loss, trainer.lr(), acc)
            log.predictions(u, kept)
            log.say(f"update {u}/{updates} val loss {loss:.4f}")
        if u % run.save_every == 0 and u < updates:  # the plan reserves these saves' time
            t3 = clock(dev)
            save_checkpoint(trainer, run_dir, u)
            log.metric("save", u, clock(dev) - t3)
    export_run(opened, log, trainer)
    return "diverged" if diverged_at else "finished"


def export_run(opened: OpenRun, log: RunLog, trainer: Trainer) -> None:
    """The weights (or adapter) exported, with the control outputs `campaign finish` compares them with."""
    t2 = clock(opened.dev)
    model_path = opened.run_dir / "model.safetensors"
    checkpoint.export(trainer, str(model_path), adapter=opened.run.export_adapter)
    reference = control_outputs(trainer)  # every process: FSDP's forward gathers from all of them
    if opened.rank == 0:
        (opened.run_dir / "reference.json").write_text(json.dumps(reference))
    barrier()
    log.metric("export", trainer.update, clock(opened.dev) - t2)
    if opened.rank == 0:
        log.event("finished", trainer.update, f"model sha256 {sha256(model_path)}")


def interrupted_run(ledger_path: str, run_id: str, campaign: str, variant: str, seed: int,
                    cfg: ProbeConfig, updates: int, out_dir: str) -> tuple[str, Path, float | None] | None:
    """The run a rerun resumes: the newest attempt of this (variant, seed), when it was interrupted, ran the same
    configuration and update count, and kept a checkpoint; with its newest checkpoint and its first training loss
    (the divergence rule's reference). Anything else starts afresh."""
    with Ledger(ledger_path) as led:
        runs, events, metrics = (led.table(t) for t in ("campaign_runs", "campaign_events", "campaign_metrics"))
    mine = runs[(runs["campaign"] == campaign) & (runs["variant"] == variant) & (runs["run_id"] != run_id)
                & (pd.to_numeric(runs["seed"], errors="coerce") == seed)]
    if mine.empty:
        return None
    last = mine.sort_values("seq").iloc[-1]
    said = events[events["run_id"] == last["run_id"]]
    if said.empty or said.sort_values("seq").iloc[-1]["event"] != "interrupted":
        return None
    before = json.loads(last["config_json"])
    if before.get("config") != dataclasses.asdict(cfg) or before.get("updates") != updates:
        return None
    kept = sorted((Path(out_dir) / str(last["run_id"])).glob("checkpoint-*.pt"))
    if not kept:
        return None
    train = metrics[(metrics["run_id"] == last["run_id"]) & (metrics["kind"] == "train")].sort_values("seq")
    return str(last["run_id"]), kept[-1], float(train["loss"].iloc[0]) if len(train) else None


def save_checkpoint(trainer, run_dir: Path, update: int) -> None:
    """The full training state at this update (probes/checkpoint.save: what resume reads), the newest
    KEPT_CHECKPOINTS kept."""
    path = run_dir / f"checkpoint-{update:09d}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)  # FSDP ranks on other nodes write their shards beside it
    checkpoint.save(trainer, str(path))
    if trainer.rank == 0:
        for old in sorted(run_dir.glob("checkpoint-*.pt"))[:-KEPT_CHECKPOINTS]:
            old.unlink()
            shutil.rmtree(f"{old}.dcp", ignore_errors=True)


class _OtherRank:
    """Ranks other than 0 write no ledger (rank 0 writes the run's rows, and on several nodes only its disk has
    the ledger). What only this rank saw go wrong (an error such as an OOM, a non-finite loss) goes to stderr,
    which torchrun shows: the other ranks then stop at their next collective, and rank 0's row says so."""

    def __init__(self, rank: int, run_id: str):
        self.rank, self.run_id = rank, run_id

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def add(self, table: str, row: dict) -> None:
        if table == "campaign_events" and row.get("event") in ("error", "diverged", "interrupted"):
            print(f"rank {self.rank}: run {self.run_id}: {row['event']} at update {row.get('update_no')}: "
                  f"{row.get('detail', '')}", file=sys.stderr, flush=True)


def _quiet(*args, **kwargs) -> None:
    pass


def data_notes(workload, cfg: ProbeConfig) -> list[str]:
    """What the workload says about its data at this configuration's lengths (truncation, where val comes
    from); workloads without such a method say nothing."""
    if not hasattr(workload, "data_report"):
        return []
    return workload.data_report({"train": cfg.seq_len, "val": cfg.eval_seq_len})


def finish_check(config_json: str, run_dir: str, seed: int = 0) -> dict:
    """In a fresh process: rebuild the model, load the exported weights, rerun the control inputs.
    The model is rebuilt from the run's seed, so an adapter export lands on the same (random) base."""
    from safetensors.torch import load_model

    torch.manual_seed(seed)
    cfg = ProbeConfig(**json.loads(config_json)["config"])
    cfg = dataclasses.replace(cfg, strategy="single", world_size=1)  # one process reads the full export
    workload = load_workload(cfg.workload, json.loads(cfg.params_json))
    trainer = Trainer(workload, cfg, torch.device("cpu"))
    path = os.path.join(run_dir, "model.safetensors")
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        adapter_only = all("lora_" in k for k in f.keys())
    if adapter_only:  # an adapter export: the base is rebuilt from the config, the adapter loaded onto it
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(trainer.model, load_file(path))
    else:
        load_model(trainer.model, path)
    now = control_outputs(trainer)
    then = json.loads(Path(run_dir, "reference.json").read_text())
    diffs = []
    if not (now["loss"] == then["loss"] or (math.isnan(now["loss"]) and math.isnan(then["loss"]))):
        diffs.append(f"control loss {now['loss']!r} now, {then['loss']!r} at export")
    if _flat(now.get("pred")) != _flat(then.get("pred")):
        diffs.append("control predictions differ from those recorded at export")
    return {"same": not diffs, "differences": diffs, "loss": now["loss"]}


def _flat(pred):
    """Predictions as one flat list (exports before the one evaluation recorded them nested per example)."""
    if not isinstance(pred, list):
        return pred
    return [x for p in pred for x in (_flat(p) if isinstance(p, list) else [p])]


def run_campaign(campaign: Campaign, variants: list[Variant], seeds: list[int] | None, ledger_path: str, out: str,
                 device: str, updates: int | None, strategy: str, say=print, echo=print) -> list[str]:
    """`rentplan campaign run`: the device's start-up once (recorded, billed to no variant), then every variant by
    priority and each of its seeds; returns the outcomes (skipped or finished before for one it did not train).
    say: progress; echo: one result line per run.
    The spec is answered here, once (campaign_spec.campaign_run): the runs never ask it anything."""
    from probes.runner import clean_stale_temporaries

    run = campaign_run(campaign, variants)
    rank, world = world_of()
    if rank == 0:  # an output folder or a ledger that cannot be written (a full disk, a read-only folder, a foreign
        problem = storage_problem(Path(out))  # SQLite file, a newer rentplan's) is refused before anything is made
        if problem:
            raise CampaignError(f"cannot write runs under {out}: {problem}. Nothing was changed; {advice(problem)} "
                                "(--out FOLDER on a writable disk).")
        with Ledger(ledger_path):
            pass
    for run_dir in (p for p in Path(out).glob("c-*") if rank == 0 and p.is_dir() and not p.is_symlink()):
        for name in clean_stale_temporaries(run_dir):
            say(f"removed {run_dir.name}/{name}: a half-written export of a run that was killed")
    # SIGTERM (a spot machine's preemption, a job cancelled) ends a run as Ctrl-C does: its run reads "interrupted",
    # not "running or crashed"; the handler is this command's only while it runs
    previous = signal.signal(signal.SIGTERM, sigterm_as_interrupt)
    try:
        return _run_variants(run, seeds, ledger_path, out, device, updates, strategy, say, echo)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_variants(run: CampaignRun, seeds, ledger_path, out, device, updates, strategy, say, echo) -> list[str]:
    rank, world = world_of()
    start_up = device_start_up(device)
    say(f"start-up: {device} ready in {start_up:.2f} s (recorded with each run, not billed to any variant)"
        + (f"; {world} processes, {strategy}" if world > 1 else ""))
    outcomes = []
    since = _last_run_seq(ledger_path) if rank == 0 else 0  # runs after it were started by other commands
    for v in sorted(run.variants, key=lambda v: v.priority):
        for seed in seeds or [v.seed]:
            # one command at a time trains a (variant, seed): a second `campaign run` of the spec skips what the
            # first is training now, and what it finished since this command started
            key, claim = f"campaign:{run.name}:{v.id}:{seed}", new_id("k")
            settings = {"config": dataclasses.asdict(variant_config(run, v, device, world, strategy)),
                        "updates": updates or run.updates}
            held = from_rank0(_claim_variant(ledger_path, key, claim, run.name, v.id, seed, since, settings)
                              if rank == 0 else None)
            if held:
                outcome, why = held
                say(f"skip {v.id} seed {seed}: {why}")
                outcomes.append(outcome)
                continue
            try:
                with holding(ledger_path, key, claim) if rank == 0 else contextlib.nullcontext():
                    run_id, outcome = run_variant(run, v, seed, ledger_path, out, device, updates, progress=say,
                                                  start_up_s=start_up, strategy=strategy)
            finally:
                release(device)
                if rank == 0:
                    with Ledger(ledger_path) as led:
                        led.release(key, claim)
            outcomes.append(outcome)
            echo(f"{run_id}  {v.id}  lr {v.lr:g}  seed {seed}  {outcome}")
    return outcomes


def _last_run_seq(ledger_path: str) -> int:
    with Ledger(ledger_path) as led:
        runs = led.table("campaign_runs")
    return int(runs["seq"].max()) if len(runs) else 0


def _claim_variant(ledger_path: str, key: str, claim: str, campaign: str, variant: str, seed: int,
                   since: int, settings: dict) -> tuple[str, str] | None:
    """None when this command may train the (variant, seed) (the claim is then its own), else (outcome, why not):
    skipped when another command trains it now or finished it since this one started; finished before when it
    finished with the same `settings` (the run's configuration and update count: a rerun continues a campaign,
    it does not pay for a run twice)."""
    with Ledger(ledger_path) as led:
        holder = led.claim(key, claim)
        if holder is not None:
            return "skipped", f"another campaign run is training it now (pid {holder['pid']} on {holder['host']})"
        runs, events = led.table("campaign_runs"), led.table("campaign_events")
        mine = runs[(runs["campaign"] == campaign) & (runs["variant"] == variant) & (runs["seed"] == seed)
                    & (runs["seq"] > since)]
        done = events[events["run_id"].isin(mine["run_id"]) & (events["event"] == "finished")]
        if not done.empty:
            led.release(key, claim)
            return "skipped", f"another campaign run finished it meanwhile (run {done['run_id'].iloc[0]})"
        same = runs[(runs["campaign"] == campaign) & (runs["variant"] == variant) & (runs["seed"] == seed)
                    & runs["config_json"].map(lambda text: _settings_of(text) == settings)]
        done = events[events["run_id"].isin(same["run_id"]) & (events["event"] == "finished")]
        if not done.empty:
            led.release(key, claim)
            return "finished before", (f"it finished with these settings (run {done['run_id'].iloc[-1]}); another "
                                       "--lr, --updates or --seeds trains a new run")
    return None


def _settings_of(config_json) -> dict | None:
    try:
        said = json.loads(config_json)
    except (TypeError, ValueError):
        return None
    return {"config": said.get("config"), "updates": said.get("updates")} if isinstance(said, dict) else None
