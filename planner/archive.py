"""Archive a finished run: weights (safetensors), configuration, code revision, raw metrics, instructions,
and a manifest with the sha256 of every file; `verify` recomputes them. Nothing here unpickles anything."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pandas as pd

from planner.errors import InputError

MANIFEST = "manifest.json"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


SNAPSHOTS = ("workload", "spec")  # copies of the workload's source and the spec, taken when the run started


def write_archive(dest: Path, run: pd.Series, run_dir: Path, metrics: pd.DataFrame, events: pd.DataFrame,
                  notes: pd.DataFrame, readme: str, ledger_rows: list[dict] | None = None) -> list[str]:
    if not (run_dir / "model.safetensors").is_file():
        raise InputError(f"run {run['run_id']} has no exported model in {run_dir}: only finished runs are archived.")
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(run_dir / "model.safetensors", dest / "model.safetensors")
    shutil.copy2(run_dir / "reference.json", dest / "reference.json")
    for folder in SNAPSHOTS:
        if (run_dir / folder).is_dir():
            shutil.copytree(run_dir / folder, dest / folder, dirs_exist_ok=True)
    if ledger_rows is not None:  # the run's own rows of every ledger table, as written
        (dest / "ledger_lines.jsonl").write_text("".join(json.dumps(r, default=str) + "\n" for r in ledger_rows))
    config = {"run": {k: (v.item() if hasattr(v, "item") else v) for k, v in run.items() if k != "config_json"},
              "training": json.loads(run["config_json"])}
    (dest / "config.json").write_text(json.dumps(config, indent=2, default=str))
    (dest / "code_revision.txt").write_text(str(run["code_revision"]) + "\n")
    metrics.drop(columns=["seq"], errors="ignore").to_csv(dest / "metrics.csv", index=False)
    events.drop(columns=["seq"], errors="ignore").to_csv(dest / "events.csv", index=False)
    notes.drop(columns=["seq"], errors="ignore").to_csv(dest / "notes.csv", index=False)
    (dest / "README.md").write_text(readme)
    files = _files(dest)
    manifest = {"format": "rentplan-archive/1", "run_id": run["run_id"],
                "files": {name: {"sha256": sha256(dest / name), "bytes": (dest / name).stat().st_size}
                          for name in files}}
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return files + [MANIFEST]


def verify_archive(dest: Path) -> list[str]:
    """Problems found (empty = intact): missing, extra or changed files."""
    path = dest / MANIFEST
    if not path.is_file():
        return [f"no {MANIFEST} in {dest}"]
    manifest = json.loads(path.read_text())
    problems = []
    for name, info in manifest["files"].items():
        f = dest / name
        if not f.is_file():
            problems.append(f"missing: {name}")
        elif sha256(f) != info["sha256"]:
            problems.append(f"changed: {name} (sha256 differs from the manifest)")
    extra = set(_files(dest)) - set(manifest["files"])
    problems += [f"not in the manifest: {name}" for name in sorted(extra)]
    return problems


def _files(dest: Path) -> list[str]:
    """Every file under dest but the manifest, as paths relative to dest."""
    return sorted(name for name in (p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
                  if name != MANIFEST)
