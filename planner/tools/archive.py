"""Archive a finished run: weights (safetensors), configuration, code revision, raw metrics, instructions,
and a manifest with the sha256 of every file; `verify` recomputes them. Nothing here unpickles anything."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pandas as pd

from planner import __version__
from planner.errors import InputError, LedgerError
from planner.inputs.schema import ManifestEntry, validate
from planner.inputs.yamlsafe import Problems
from planner.ledger import Ledger
from planner.outputs.render import render_template
from planner.outputs.report import campaign_frames, run_table

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


def recorded_model_sha256(events: pd.DataFrame, run_id: str) -> str | None:
    """The sha256 of the exported weights, as the run's `finished` event recorded it."""
    done = events[(events["run_id"] == run_id) & (events["event"] == "finished")]
    for detail in done["detail"]:
        m = re.search(r"model sha256 ([0-9a-f]{64})", str(detail))
        if m:
            return m.group(1)
    return None


def verify_archive(dest: Path, recorded=None) -> tuple[list[str], str]:
    """(problems, basis): missing, extra, changed, linked or escaping files; and, where `recorded(run_id)`
    gives the ledger's sha256 of the weights, whether the archived weights are the ones the run exported."""
    path = dest / MANIFEST
    if not dest.is_dir():
        raise InputError(f"{dest} is not an archive folder. Make one with `rentplan archive RUN --to {dest}`.")
    if not path.is_file() or path.is_symlink():
        return [f"no {MANIFEST} in {dest}: not an archive (Make one with `rentplan archive RUN --to DIR`)"], \
            "nothing to check against"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(f"{path} is not a rentplan archive manifest ({e}).") from None
    p = Problems(str(path))
    entry = validate(ManifestEntry, manifest, p, "")
    if entry is None:
        raise InputError(f"{path} is not a rentplan archive manifest: " + "; ".join(p.items[:8]))
    files = {name: {"sha256": f.sha256, "bytes": f.bytes} for name, f in entry.files.items()}
    problems = []
    root = Path(os.path.abspath(dest))
    for name, info in files.items():
        f = dest / name
        if Path(name).is_absolute() or ".." in Path(name).parts or not _inside(f, root):
            problems.append(f"{name!r} points outside the archive: refused")
        elif f.is_symlink() or any(p.is_symlink() for p in f.parents if _inside(p, root) and p != root):
            problems.append(f"{name} is a symlink: refused (an archive holds its own files)")
        elif not f.is_file():
            problems.append(f"missing: {name}")
        elif sha256(f) != info["sha256"]:
            problems.append(f"changed: {name} (sha256 differs from the manifest)")
    links = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_symlink())
    problems += [f"{name} is a symlink: refused (an archive holds its own files)" for name in links
                 if f"{name} is a symlink: refused (an archive holds its own files)" not in problems]
    extra = set(_files(dest)) - set(files) - set(links)
    problems += [f"not in the manifest: {name}" for name in sorted(extra)]
    problems += _strange_entries(dest)
    basis = "checked against the manifest only (pass --ledger with the run's ledger to check the weights " \
            "against the sha256 the run recorded)"
    want = recorded(str(manifest.get("run_id"))) if recorded is not None else None
    if want is not None:
        basis = (f"checked against the manifest and against the sha256 the ledger recorded for "
                 f"{manifest.get('run_id')}'s weights ({getattr(recorded, 'source', 'ledger')})")
        model = dest / "model.safetensors"
        if model.is_file() and not model.is_symlink() and sha256(model) != want:
            problems.append("model.safetensors differs from the weights the ledger recorded when the run "
                            "exported (the manifest was recomputed after a change)")
    return problems, basis


def _no_duplicate_keys(pairs):
    keys = [k for k, _ in pairs]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise ValueError(f"duplicate key {dup[0]!r}: which one holds is not defined")
    return dict(pairs)


def _strange_entries(dest: Path) -> list[str]:
    """What an archive never holds: a fifo, socket or device node, or an empty folder (made after it was written)."""
    import stat

    out = []
    for p in sorted(dest.rglob("*")):
        name = p.relative_to(dest).as_posix()
        if p.is_symlink():
            continue
        mode = p.lstat().st_mode
        if stat.S_ISDIR(mode):
            if not any(p.iterdir()):
                out.append(f"{name} is an empty folder: not in the manifest")
        elif not stat.S_ISREG(mode):
            kind = ("a fifo" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device node"
                    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
            out.append(f"{name} is {kind}: refused (an archive holds regular files)")
    return out


def _inside(p: Path, root: Path) -> bool:
    try:
        Path(os.path.abspath(p)).relative_to(root)
        return True
    except ValueError:
        return False


def _files(dest: Path) -> list[str]:
    """Every file under dest but the manifest, as paths relative to dest."""
    return sorted(name for name in (p.relative_to(dest).as_posix() for p in dest.rglob("*")
                                    if p.is_file() and not p.is_symlink()) if name != MANIFEST)


def recorded_sha256_lookup(ledger_path: str):
    """run_id -> the model sha256 the ledger recorded when that run finished (None when the ledger is absent,
    not a ledger, or has no such run): the basis that a recomputed manifest cannot fake."""
    def lookup(run_id: str) -> str | None:
        if not Path(ledger_path).is_file():
            return None
        try:
            with Ledger(ledger_path, create=False) as led:
                return recorded_model_sha256(led.table("campaign_events"), run_id)
        except LedgerError:
            return None

    lookup.source = ledger_path  # type: ignore[attr-defined]  # named in verify_archive's message
    return lookup


def archived_reference(ref: str, inputs: dict) -> str:
    """The workload reference that loads the archive's own copy, from the archive's folder (`workload/file.py:fn`);
    a module reference (package.module:fn) or a built-in stays as it was."""
    target, _, func = ref.rpartition(":")
    copy = (inputs.get("workload") or {}).get("file")
    if copy and func and (target.endswith(".py") or "/" in target or os.sep in target):
        return f"{copy}:{func}"
    return ref


def campaign_run_row(ledger_path: str, run_id: str) -> pd.Series:
    with Ledger(ledger_path, create=False) as led:
        runs = led.table("campaign_runs")
    hit = runs[runs["run_id"] == run_id]
    if hit.empty:
        raise InputError(f"no campaign run {run_id!r} in {ledger_path}; `rentplan campaign report` lists them.")
    return hit.iloc[0]


def archive_run(ledger_path: str, run_id: str, dest: Path, runs_dir: Path) -> list[str]:
    """`rentplan archive RUN --to DEST`: the run's rows from every campaign table, its files from runs_dir, a
    README and a manifest, written to dest; returns the files' names."""
    target = run_id
    run = campaign_run_row(ledger_path, target)
    runs, events, metrics, notes = campaign_frames(ledger_path, None)
    status = run_table(runs[runs["run_id"] == target], events, metrics).iloc[0]["status"]
    saved = json.loads(run["config_json"])
    cfg = saved["config"]
    readme = render_template("archive_readme.md.j2", {
        "run_id": target, "variant": run["variant"], "campaign": run["campaign"], "version": __version__,
        "device": run["device_name"], "torch_version": run["torch_version"], "code_revision": run["code_revision"],
        "started_at": run["started_at"], "status": status, "dest": str(dest),
        "workload": archived_reference(cfg["workload"], saved.get("inputs") or {}),
        "params": repr(json.loads(cfg["params_json"] or "{}")),
        "has_workload": "workload" in (saved.get("inputs") or {}), "has_spec": "spec" in (saved.get("inputs") or {})})
    with Ledger(ledger_path, create=False) as led:
        rows = [{"table": t, **{k: (None if pd.isna(v) else v) for k, v in row.items() if k != "seq"}}
                for t in ("campaign_runs", "campaign_events", "campaign_metrics", "campaign_predictions")
                for row in (lambda df: df[df["run_id"] == target])(led.table(t)).to_dict(orient="records")]
    files = write_archive(dest, run, runs_dir / target, metrics[metrics["run_id"] == target],
                          events[events["run_id"] == target], notes[notes["run_id"].isin([target, None])], readme,
                          rows)
    return files
