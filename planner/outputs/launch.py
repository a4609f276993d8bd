"""What an order carries to the rented machine, and where each file lands there.

`sky launch` runs in the launch folder (where `plan` ran); SkyPilot syncs it to `~/sky_workdir` (the run's
working folder) but leaves out what .gitignore or .skyignore names, and `rentplan-out/` is usually ignored.
A file named in `file_mounts` is uploaded whatever the ignore files say (SkyPilot's
`sky/data/storage_utils.zip_files_and_folders`: "Add the file to the zip archive even if it matches patterns in
dot ignore files, as it was explicitly specified by user"), so every file the run reads is mounted by name:

- inside the launch folder: at the same relative path under `~/sky_workdir` (SkyPilot's task validation asks for
  "the full path to the file/folder" to upload into the workdir), so the workload's own relative imports and
  paths hold as they do here;
- outside it (the demo's packaged spec, an `--out` elsewhere, a workload in another folder): under
  `~/sky_workdir/.rentplan-launch/N/NAME`.

The campaign the run starts is `order-campaign.yaml` beside order.json: the user's spec as loaded, with its
workload and data paths rewritten relative to where they land. order.json names the same files relative to the
remote working folder, where `rentplan verify` runs.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from planner.inputs.campaign_spec import FILE_PARAMS, parse_campaign, resolve_path
from planner.inputs.yamlsafe import load_yaml_file

REMOTE_WORKDIR = "~/sky_workdir"
OUTSIDE = ".rentplan-launch"
SPEC_NAME = "order-campaign.yaml"
OWN_LOOPS = ("trainer:", "lightning:", "script:")  # workloads measured by callbacks or probe --script


@dataclass
class Layout:
    """Local files and the paths (relative to the remote working folder) they are mounted at."""

    root: Path  # the launch folder
    mounts: dict[str, str] = field(default_factory=dict)  # remote relative path -> local path as sky reads it

    def place(self, local: str | Path) -> str:
        path = Path(os.path.abspath(local))
        try:
            rel = path.relative_to(self.root).as_posix()
            source = rel
        except ValueError:
            known = {v: k for k, v in self.mounts.items()}
            if str(path) in known:
                return known[str(path)]
            rel = f"{OUTSIDE}/{sum(1 for k in self.mounts if k.startswith(OUTSIDE + '/')) + 1}/{path.name}"
            source = str(path)
        self.mounts[rel] = source
        return rel

    def file_mounts(self) -> dict[str, str]:
        return {f"{REMOTE_WORKDIR}/{rel}": src for rel, src in sorted(self.mounts.items())}


def _relative_to(target: str, folder: str) -> str:
    return posixpath.relpath(target, folder or ".")


def place_workload(ref: str, base_dir: str, layout: Layout, folder: str) -> str:
    """The reference as it reads from `folder` (relative to the remote workdir) once its file is mounted."""
    if ref.startswith(("builtin:", *OWN_LOOPS)):
        return ref
    if ref.startswith("hf:"):
        return "hf:" + _relative_to(layout.place(resolve_path(ref[3:], base_dir)), folder)
    target, sep, func = ref.rpartition(":")
    if sep and (target.endswith(".py") or "/" in target):
        return f"{_relative_to(layout.place(resolve_path(target, base_dir)), folder)}:{func}"
    return ref  # package.module:function: found on the remote through the working folder (workdir sync)


def place_params(params: dict, base_dir: str, layout: Layout, folder: str) -> dict:
    return {k: (_relative_to(layout.place(resolve_path(v, base_dir)), folder)
                if k in FILE_PARAMS and isinstance(v, str) else v) for k, v in params.items()}


@dataclass
class Launch:
    order: dict  # order.json as the rented machine reads it
    spec_text: str | None  # order-campaign.yaml (None for the user's own loop: rentplan does not start it)
    order_path: str  # relative to the remote working folder
    spec_path: str | None
    layout: Layout


def launch_files(order: dict, spec_path: str, out_dir: str, root: str | None = None) -> Launch:
    """The order for the rented machine and the campaign spec it runs, with every file they name mounted."""
    layout = Layout(Path(os.path.abspath(root or os.getcwd())))
    order_rel = layout.place(Path(out_dir) / "order.json")
    folder = posixpath.dirname(order_rel)
    settings = dict(order["settings"])
    spec = Path(spec_path)
    base_dir = str(spec.resolve().parent)
    # verify runs in the remote working folder: its paths are relative to it
    settings["workload"] = place_workload(settings["workload"], base_dir, layout, "")
    settings["params"] = place_params(settings.get("params") or {}, base_dir, layout, "")
    machine_order = {**order, "settings": settings}
    if str(order["settings"]["workload"]).startswith(OWN_LOOPS):
        return Launch(machine_order, None, order_rel, None, layout)
    spec_rel = layout.place(Path(out_dir) / SPEC_NAME)
    data = load_yaml_file(spec, "campaign")
    data["workload"] = place_workload(data["workload"], base_dir, layout, folder)
    data["params"] = place_params(data.get("params") or {}, base_dir, layout, folder)
    text = ("# The campaign as ordered (written by rentplan plan from the spec named in order.json's provenance):\n"
            "# paths are relative to this file's folder on the rented machine.\n"
            + yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=1000))
    parse_campaign(yaml.safe_load(text), SPEC_NAME)  # what the run will load must load
    return Launch(machine_order, text, order_rel, spec_rel, layout)
