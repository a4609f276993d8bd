"""Run the campaign itself, on the same Trainer the pilot measured: every variant (and seed) keeps the
control's architecture, data, effective batch and update budget; only the declared variable differs.

Per update: loss and learning rate; per validation point: mean loss (and accuracy where the workload can
predict); stop rules declared in the spec (non-finite loss, divergence threshold). Every run has an id,
its events are appended (started, evaluated, finished | diverged | error | interrupted), nothing is edited.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from planner.archive import sha256
from planner.campaign import Campaign, Variant
from planner.ledger import Ledger, new_id
from planner.records import ProbeConfig
from probes.loop import NonFinite, Trainer, to_device
from probes.pilot import environment, last_line
from probes.workloads import load_workload

CONTROL_EXAMPLES = 4


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def code_revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, timeout=10)
        if rev.returncode == 0:
            return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown (not a git checkout)"


def variant_config(campaign: Campaign, variant: Variant, device: str) -> ProbeConfig:
    mb = campaign.micro_batch or max(d for d in range(1, min(8, campaign.effective_batch) + 1)
                                     if campaign.effective_batch % d == 0)
    return ProbeConfig(workload=campaign.workload, params_json=campaign.params_json, micro_batch=mb,
                       seq_len=campaign.seq_len or 128, eval_seq_len=campaign.eval.seq_len,
                       eval_micro_batch=campaign.eval.micro_batch or mb, grad_accum=campaign.effective_batch // mb,
                       precision=campaign.precision, checkpointing=campaign.checkpointing,
                       optimizer=campaign.optimizer, lr=variant.lr, device=device)


def evaluate(trainer: Trainer, campaign: Campaign) -> tuple[float, float | None]:
    """Mean validation loss over the campaign's eval examples (and accuracy when predict() exists)."""
    ev, w = campaign.eval, trainer.workload
    mb = ev.micro_batch or trainer.cfg.micro_batch
    losses, right, total = [], 0, 0
    trainer.model.eval()
    try:
        with torch.no_grad():
            for i in range(max(1, ev.examples // mb)):
                b = to_device(trainer.batch(i, "val", mb, ev.seq_len), trainer.device)
                with trainer.autocast():
                    losses.append(float(w.compute_loss(trainer.model, b)))
                    if hasattr(w, "predict"):
                        pred, target = w.predict(trainer.model, b)
                        right += int((pred == target).sum())
                        total += int(target.numel())
    finally:
        trainer.model.train()
    return sum(losses) / len(losses), (right / total if total else None)


def control_outputs(trainer: Trainer) -> dict:
    """Outputs on fixed control inputs, recorded at export and compared by `finish`."""
    b = to_device(trainer.batch(0, "control", CONTROL_EXAMPLES, trainer.cfg.seq_len), trainer.device)
    trainer.model.eval()
    with torch.no_grad():
        out = {"loss": float(trainer.workload.compute_loss(trainer.model, b))}
        if hasattr(trainer.workload, "predict"):
            out["pred"] = trainer.workload.predict(trainer.model, b)[0].tolist()
    trainer.model.train()
    return out


def run_variant(campaign: Campaign, variant: Variant, seed: int, ledger_path: str, out_dir: str,
                device: str = "cpu", updates: int | None = None, progress=print) -> str:
    """Train one variant with one seed; returns its run id. Lines go to the ledger as they happen."""
    updates = updates or campaign.updates
    run_id = new_id("c")
    cfg = variant_config(campaign, variant, device)
    dev = torch.device(device)
    env = environment(dev)
    run_dir = Path(out_dir) / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    with Ledger(ledger_path) as led:
        led.add("campaign_runs", {"run_id": run_id, "campaign": campaign.name, "variant": variant.id, "seed": seed,
                                  "lr": variant.lr, "config_json": json.dumps({"campaign": campaign.source,
                                                                               "config": dataclasses.asdict(cfg),
                                                                               "updates": updates}),
                                  "device": env["device"], "device_name": env["device_name"],
                                  "torch_version": env["torch_version"], "code_revision": code_revision(),
                                  "started_at": _now()})
        led.add("campaign_events", {"run_id": run_id, "event": "started", "update_no": 0, "detail": "", "at": _now()})

        def event(name: str, update: int, detail: str = "") -> None:
            led.add("campaign_events", {"run_id": run_id, "event": name, "update_no": update, "detail": detail,
                                        "at": _now()})

        torch.manual_seed(seed)
        try:
            trainer = Trainer(load_workload(campaign.workload, campaign.params), cfg, dev)
            limit = campaign.stop_if.get("loss_above")
            for _ in range(updates):
                t0 = time.perf_counter()
                try:
                    res = trainer.train_update()
                except NonFinite as e:
                    event("diverged", e.update, f"non-finite loss at update {e.update} (stop rule nonfinite)")
                    progress(f"{variant.id} seed {seed}: diverged at update {e.update}")
                    return run_id
                u = trainer.update
                led.add("campaign_metrics", {"run_id": run_id, "update_no": u, "kind": "train", "loss": res.loss,
                                             "lr": trainer.lr(), "accuracy": None,
                                             "seconds": time.perf_counter() - t0, "at": _now()})
                if limit is not None and res.loss > limit:
                    event("diverged", u, f"loss {res.loss:.4g} above the declared threshold {limit} (stop rule)")
                    progress(f"{variant.id} seed {seed}: diverged at update {u}")
                    return run_id
                if u % campaign.eval.every_updates == 0 or u == updates:
                    t1 = time.perf_counter()
                    loss, acc = evaluate(trainer, campaign)
                    led.add("campaign_metrics", {"run_id": run_id, "update_no": u, "kind": "val", "loss": loss,
                                                 "lr": trainer.lr(), "accuracy": acc,
                                                 "seconds": time.perf_counter() - t1, "at": _now()})
                    progress(f"{variant.id} seed {seed}: update {u}/{updates} val loss {loss:.4f}")
            t2 = time.perf_counter()
            from safetensors.torch import save_model

            from probes.hf import export_adapter

            model_path = run_dir / "model.safetensors"
            if not (campaign.export == "adapter" and export_adapter(trainer.model, str(model_path))):
                save_model(trainer.model, str(model_path))  # the whole model (or no adapter to export)
            (run_dir / "reference.json").write_text(json.dumps(control_outputs(trainer)))
            led.add("campaign_metrics", {"run_id": run_id, "update_no": trainer.update, "kind": "export",
                                         "loss": None, "lr": None, "accuracy": None,
                                         "seconds": time.perf_counter() - t2, "at": _now()})
            event("finished", trainer.update, f"model sha256 {sha256(model_path)}")
        except KeyboardInterrupt:
            event("interrupted", 0, "interrupted (Ctrl-C)")
            raise
        except Exception as e:  # noqa: BLE001  the run stays in the ledger, marked
            event("error", 0, last_line(e))
            progress(f"{variant.id} seed {seed}: error: {last_line(e)}")
    return run_id


def finish_check(config_json: str, run_dir: str, seed: int = 0) -> dict:
    """In a fresh process: rebuild the model, load the exported weights, rerun the control inputs.
    The model is rebuilt from the run's seed, so an adapter export lands on the same (random) base."""
    from safetensors.torch import load_model

    torch.manual_seed(seed)
    cfg = ProbeConfig(**json.loads(config_json)["config"])
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
    if now.get("pred") != then.get("pred"):
        diffs.append("control predictions differ from those recorded at export")
    return {"same": not diffs, "differences": diffs, "loss": now["loss"]}
