"""A sky.yaml launched the way SkyPilot launches it, without a cloud: SkyPilot's own parser and upload rule, then
its setup and run sections against stub commands on a copy of what would reach the machine.

1. In SkyPilot's environment (`make sky` builds it; tests skip without it): `sky.Task.from_yaml`, `validate`
   (paths resolved from the launch folder, as `sky launch` does), then `storage_utils.zip_files_and_folders` over
   the workdir and every file mount: the function SkyPilot's client uses to upload them, with its .gitignore /
   .skyignore exclusions.
2. Here: the archive is unpacked, the workdir placed at ~/sky_workdir and each mount at its target, in SkyPilot's
   stage order (workdir, then file mounts), under a stand-in home folder.
3. setup and run run in bash from ~/sky_workdir with stubs first on PATH: `python3 -m venv` makes the venv,
   `pip` records what it installs, `rentplan` and `torchrun` load every file they are handed with rentplan's own
   loaders (order.json, the campaign spec, the workload file the spec names) and fail when one is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKY_PYTHON = os.environ.get("RENTPLAN_SKY_PYTHON", str(ROOT / ".venv-sky" / "bin" / "python"))
SKY_READY = "RENTPLAN_SKY_PYTHON" in os.environ or (ROOT / ".venv-sky" / "installed").exists()

UPLOAD = """
import json, sys
import sky
from sky.data import storage_utils
task = sky.Task.from_yaml(sys.argv[1])
task.expand_and_validate_workdir()  # relative paths from the launch folder, as `sky launch` resolves them
task.expand_and_validate_file_mounts()
items = [task.workdir] + [src for src in (task.file_mounts or {}).values()]
storage_utils.zip_files_and_folders(items, sys.argv[2])
(r,) = list(task.resources)
print(json.dumps({"workdir": task.workdir, "file_mounts": task.file_mounts, "setup": task.setup, "run": task.run,
                  "envs": task.envs, "accelerators": r.accelerators, "num_nodes": task.num_nodes}))
"""

# The stub of rentplan (and of torchrun's `-m planner.cli`): every file an argument names is loaded with rentplan's
# own loaders, and so are the files those files name; nothing is run.
STUB = r'''#!{python}
import json, os, sys
sys.path.insert(0, {root!r})
with open(os.path.join(os.environ["STUB_LOG"]), "a") as log:
    log.write(json.dumps([os.path.basename(sys.argv[0])] + sys.argv[1:]) + "\n")
args = sys.argv[1:]
if os.path.basename(sys.argv[0]) == "torchrun":
    args = args[args.index("planner.cli") + 1:]
from planner.errors import RentplanError
from planner.inputs.campaign_spec import FILE_PARAMS, load_campaign, resolve_params, resolve_workload
from planner.outputs.orders import load_order
from probes.workloads import locate_workload

def params_exist(params):
    for k in FILE_PARAMS:
        if isinstance(params.get(k), str) and not os.path.exists(params[k]):
            sys.exit(f"stub: {{k}} file {{params[k]}} is not on the machine")

try:
    if args[0] == "verify":
        order = load_order(args[1])
        print("stub verify:", locate_workload(order["settings"]["workload"]))
        params_exist(order["settings"]["params"])
    elif args[:2] == ["campaign", "run"]:
        c = load_campaign(args[2])
        print("stub campaign run:", locate_workload(resolve_workload(c.workload, c.base_dir)))
        params_exist(resolve_params(c.params, c.base_dir))
    else:
        sys.exit(f"stub: unexpected rentplan command {{args}}")
except RentplanError as e:
    sys.exit(f"stub: {{e}}")
'''

PIP = r'''#!/bin/sh
echo "pip $*" >> "$STUB_LOG.pip"
'''

PYTHON3 = r'''#!/bin/sh
# python3 -m venv DIR: a venv whose activate script changes nothing (the stubs are already first on PATH)
[ "$1" = "-m" ] && [ "$2" = "venv" ] || exit 3
mkdir -p "$3/bin" && echo ": stub venv" > "$3/bin/activate"
'''


def upload(sky_yaml: Path, launch_dir: Path, zip_path: Path) -> dict:
    if not SKY_READY:
        pytest.skip(f"SkyPilot is not installed: run `make sky` (it builds {SKY_PYTHON})")
    r = subprocess.run([SKY_PYTHON, "-c", UPLOAD, str(sky_yaml), str(zip_path)], cwd=launch_dir, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "SKYPILOT_DISABLE_USAGE_COLLECTION": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def place(zip_path: Path, task: dict, server: Path, home: Path) -> None:
    """What the upload would put on the machine: the workdir at ~/sky_workdir, then each mount at its target."""
    with zipfile.ZipFile(zip_path) as z:
        z.extractall(server)
    inside = lambda p: server / str(p).lstrip("/")  # noqa: E731  archive names are the local absolute paths
    shutil.copytree(inside(task["workdir"]), home / "sky_workdir", symlinks=True)
    for target, src in (task["file_mounts"] or {}).items():
        dst = home / target.removeprefix("~/")
        dst.parent.mkdir(parents=True, exist_ok=True)
        if inside(src).is_dir():
            shutil.copytree(inside(src), dst, symlinks=True, dirs_exist_ok=True)
        else:
            shutil.copy2(inside(src), dst)


def stubs(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in (("rentplan", STUB.format(python=sys.executable, root=str(ROOT))),
                       ("torchrun", STUB.format(python=sys.executable, root=str(ROOT))),
                       ("pip", PIP), ("python3", PYTHON3)):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


def launch(sky_yaml: Path, launch_dir: Path, tmp: Path) -> dict:
    """Upload, place, then run setup and run; returns the task, the commands each stub saw and the outputs."""
    tmp.mkdir(parents=True, exist_ok=True)
    task = upload(sky_yaml, launch_dir, tmp / "upload.zip")
    home = tmp / "home"
    place(tmp / "upload.zip", task, tmp / "server", home)
    log = tmp / "stub.log"
    env = {"PATH": f"{stubs(tmp / 'stubs')}:/usr/bin:/bin", "HOME": str(home), "STUB_LOG": str(log),
           "SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2", "SKYPILOT_NUM_NODES": "1", "SKYPILOT_NODE_RANK": "0",
           "SKYPILOT_NUM_GPUS_PER_NODE": "1", "LANG": "C.UTF-8"}
    out = {}
    for section in ("setup", "run"):
        r = subprocess.run(["bash", "-c", task[section]], cwd=home / "sky_workdir", env=env, capture_output=True,
                           text=True, timeout=300)
        out[section] = r
    calls = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    pips = (Path(str(log) + ".pip").read_text().splitlines() if Path(str(log) + ".pip").exists() else [])
    return {"task": task, "setup": out["setup"], "run": out["run"], "calls": calls, "pip": pips, "home": home}
