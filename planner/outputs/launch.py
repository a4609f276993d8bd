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
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from planner.errors import InputError
from planner.inputs.campaign_spec import FILE_PARAMS, parse_campaign, resolve_path
from planner.inputs.modules import local_modules
from planner.inputs.yamlsafe import load_yaml_file

REMOTE_WORKDIR = "~/sky_workdir"
OUTSIDE = ".rentplan-launch"
SPEC_NAME = "order-campaign.yaml"
OWN_LOOPS = ("trainer:", "lightning:", "script:")  # workloads measured by callbacks or probe --script
# SkyPilot makes each mount's folder on the machine with an unquoted `mkdir -p DIR` (sky/backends/
# backend_utils.py, _execute_file_mounts / sky/utils/command_runner): every part of a path it uploads to must be
# a word no shell reads twice. Local sources reach rsync quoted by Python's repr, which a quote, `$`, a backtick
# or a backslash get through.
SAFE_PART = re.compile(r"[A-Za-z0-9._][A-Za-z0-9._-]*")
UNSAFE_SOURCE = re.compile(r"['\"$`\\]")
MAX_FILES = 2000  # files a folder mount may hold, each named (a folder mount would apply .gitignore again)
SKIP_DIRS = {".git", "__pycache__"}


def launch_path_problem(rel: str) -> str | None:
    for part in rel.split("/"):
        if not SAFE_PART.fullmatch(part):
            return (f"its part {part!r} is not letters, digits, '.', '_' and '-' (not first): SkyPilot creates mount "
                    "folders on the machine with an unquoted `mkdir -p`, so rentplan carries no other name there")
    return None


class Unmountable(InputError):
    """A file sky.yaml cannot carry under its name (the plan is still written: only sky.yaml and the campaign it
    runs are left out, with this reason on stdout and the sheet)."""


def source_problem(path: Path | str, what: str) -> None:
    if UNSAFE_SOURCE.search(str(path)):
        raise Unmountable(f"{what} {path}: a quote, '$', a backtick or a backslash in a path that SkyPilot uploads "
                          "reaches a shell on this machine; rename it")


def _inside(path: Path, folders) -> bool:
    return any(path.is_relative_to(f) for f in folders)


def _own_tree(folder: Path) -> Path:
    """Where links found in a mounted folder may lead: the folder itself, or, for a snapshot of the Hugging Face
    cache (models--ORG--NAME/snapshots/REV, whose files are links into ../../blobs), its cache entry."""
    if folder.parent.name == "snapshots" and (folder.parent.parent / "blobs").is_dir():
        return folder.parent.parent.resolve()
    return folder.resolve()


@dataclass
class Layout:
    """Local files and the paths (relative to the remote working folder) they are mounted at.

    What rentplan adds by itself (the .py files beside a workload, the files of a mounted folder) follows three
    rules: a name .skyignore lists is not added (SkyPilot's own word for what stays home; .gitignore is not, since
    the files a run needs are often git-ignored); a link is followed only to a file inside the launch folder or the
    folder it was found in (a Hugging Face cache snapshot: its cache entry), else the plan is refused naming it; a
    linked folder is never walked. A file the spec names itself is mounted as named (the user asked for it)."""

    root: Path  # the launch folder
    mounts: dict[str, str] = field(default_factory=dict)  # remote relative path -> local path as sky reads it
    outside: dict[str, int] = field(default_factory=dict)  # a folder outside the launch folder -> its number
    sizes: dict[str, int] = field(default_factory=dict)  # remote relative path -> bytes uploaded
    _ignore: Any = None  # the .skyignore matcher (pathspec, imported when first needed)

    def place(self, local: str | Path, what: str, found: bool = False) -> str | None:
        """Mount a file (or every file of a folder, each by name) and return where it lands, relative to the remote
        working folder. `what` names it in an error (e.g. "the workload file"); `found`: rentplan found it (a
        sibling), the user did not name it; such a file that .skyignore lists is left home (None)."""
        path = Path(os.path.abspath(local))
        if found:
            if self._ignored(path):
                return None  # .skyignore is the user's word on what stays home
            self._check_link(path, [self.root.resolve(), path.parent.resolve()], what)
            if not path.is_file():  # a folder named x.py, a FIFO: not a module beside the workload
                return None
        if not path.exists():
            raise InputError(f"{what} {path} does not exist: sky.yaml would carry it to the machine. Fix the "
                             "path in the campaign spec.")
        rel = self._target(path, what)
        if path.is_dir():
            self._folder(path, rel, what)
        else:
            self._add(rel, path, what)
        return rel

    def mount(self, local: str | Path, what: str) -> str:
        """place() of what the user named: it always lands (or the plan stops); only a found file stays home."""
        rel = self.place(local, what)
        assert rel is not None
        return rel

    def place_at(self, local: Path, rel: str, what: str) -> None:
        """Mount a file rentplan found at a given place (a module at its path beside the workload), under the same
        rules as place(found=True)."""
        if rel in self.mounts or self._ignored(local):
            return
        self._check_link(local, [self.root.resolve(), local.parent.resolve()], what)
        why = launch_path_problem(rel)
        if why:
            raise Unmountable(f"{what} {rel}: {why}. Rename it")
        self._add(rel, local, what)

    def reserve(self, local: str | Path, what: str) -> str:
        """A file this plan is about to write (order.json, the campaign as ordered): rentplan's own, so where its
        name cannot travel it lands under a safe one."""
        path = Path(os.path.abspath(local))
        try:
            rel = self._target(path, what)
        except Unmountable:
            if UNSAFE_SOURCE.search(str(path)):
                raise
            rel = f"{OUTSIDE}/order/{path.name}"
        source_problem(path, what)
        self.mounts[rel] = self._source(path)
        return rel

    def _add(self, rel: str, path: Path, what: str) -> None:
        """Mount one file at rel: a link travels as the file it names (SkyPilot would copy a link as a link)."""
        if path.is_symlink():
            path = Path(os.path.realpath(path))
        source_problem(path, what)
        self.mounts[rel] = self._source(path)
        self.sizes[rel] = path.stat().st_size

    def _target(self, path: Path, what: str) -> str:
        source_problem(path, what)
        try:
            rel = path.relative_to(self.root).as_posix()
        except ValueError:
            n = self.outside.setdefault(str(path.parent), len(self.outside) + 1)
            name = re.sub(r"[^A-Za-z0-9._-]", "_", path.name).lstrip("-") or "file"
            rel = f"{OUTSIDE}/{n}/{name}"
        why = launch_path_problem(rel)
        if why:
            raise Unmountable(f"{what} {rel}: {why}. Rename it, or plan from (or --out into) a folder without it")
        return rel

    def _folder(self, path: Path, rel: str, what: str) -> None:
        tree, files = [self.root.resolve(), _own_tree(path)], []
        for top, dirs, names in os.walk(path):
            for d in dirs:
                if not self._ignored(Path(top, d)):
                    self._check_link(Path(top, d), tree, what)  # a linked folder is refused, never walked
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not os.path.islink(os.path.join(top, d)))
            files += [Path(top) / n for n in sorted(names) if not self._ignored(Path(top) / n)]
            if len(files) > MAX_FILES:
                raise InputError(f"{what} {path} holds more than {MAX_FILES} files: mount it yourself (a SkyPilot "
                                 "storage mount) and name its path on the machine.")
        for f in files:
            self._check_link(f, tree, what)
            if not f.is_file():  # a FIFO or a socket: nothing SkyPilot can upload
                raise Unmountable(f"{what}: {f} is not a regular file (a FIFO or socket)")
            sub = f"{rel}/{f.relative_to(path).as_posix()}"
            why = launch_path_problem(sub)
            if why:
                raise Unmountable(f"{what}: {sub}: {why}. Rename it")
            self._add(sub, f, what)

    def _check_link(self, path: Path, allowed: list[Path], what: str) -> None:
        if not path.is_symlink():
            return
        real = Path(os.path.realpath(path))
        if real.is_dir():
            raise InputError(f"{what} {path} links to a folder ({real}): rentplan walks no linked folder. Copy "
                             "its files in, or list it in .skyignore.")
        if not _inside(real, allowed):
            raise InputError(f"{what} {path} links to {real}, outside the launch folder {self.root} and the folder "
                             "it sits in: sky.yaml would upload that file. Remove the link, or list it in .skyignore.")

    def _ignored(self, path: Path) -> bool:
        """Whether the launch folder's .skyignore lists `path`, by its name or, for a link, by the file it names
        (gitignore patterns, as SkyPilot reads them)."""
        if self._ignore is None:
            import pathspec

            f = self.root / ".skyignore"
            lines = f.read_text(encoding="utf-8", errors="replace").splitlines() if f.is_file() else []
            self._ignore = pathspec.GitIgnoreSpec.from_lines(lines)
        return any(self._ignore.match_file(rel) or (p.is_dir() and self._ignore.match_file(rel + "/"))
                   for p, root in ((path, self.root), (Path(os.path.realpath(path)), self.root.resolve()))
                   if p.is_relative_to(root) and (rel := p.relative_to(root).as_posix()))

    def _source(self, path: Path) -> str:
        """As sky reads it from the launch folder: './rel' inside it (a leading '~' or '-' stays a name), else the
        absolute path."""
        try:
            return "./" + path.relative_to(self.root).as_posix()
        except ValueError:
            return str(path)

    def file_mounts(self) -> dict[str, str]:
        return {f"{REMOTE_WORKDIR}/{rel}": src for rel, src in sorted(self.mounts.items())}

    def upload_bytes(self) -> int:
        return sum(self.sizes.values())


def _relative_to(target: str, folder: str) -> str:
    return posixpath.relpath(target, folder or ".")


def place_workload(ref: str, base_dir: str, layout: Layout, folder: str) -> str:
    """The reference as it reads from `folder` (relative to the remote workdir) once its file is mounted; a
    workload file's sibling .py files travel with it (its own imports)."""
    if ref.startswith(("builtin:", *OWN_LOOPS)):
        return ref
    if ref.startswith("hf:"):
        return "hf:" + _relative_to(layout.mount(resolve_path(ref[3:], base_dir), "the hf: model folder"), folder)
    target, sep, func = ref.rpartition(":")
    if sep and (target.endswith(".py") or "/" in target):
        path = Path(resolve_path(target, base_dir))
        for sibling in sorted(path.parent.glob("*.py")) if path.is_file() else []:
            if sibling != path:
                layout.place(sibling, "a module beside the workload file", found=True)
        rel = layout.mount(path, "the workload file")
        if path.is_file():  # and every module it imports from its folder's subpackages, where it will look for them
            here = path.resolve().parent
            for f in local_modules(path)[1:]:
                layout.place_at(f, posixpath.join(posixpath.dirname(rel), f.relative_to(here).as_posix()),
                                "a module the workload imports")
        return f"{_relative_to(rel, folder)}:{func}"
    if sep:  # package.module:function: found on the machine through the working folder (on PYTHONPATH there)
        place_module(target, layout)
    return ref


def place_module(target: str, layout: Layout) -> None:
    """A workload module must sit in the launch folder (the machine's import path is the working folder); its
    package's __init__ files and the .py files beside it are mounted, so they arrive whatever .gitignore says."""
    from importlib.machinery import PathFinder

    parts, spec = target.split("."), None
    search: list[str] | None = [str(layout.root)]
    chain = []
    for i in range(len(parts)):
        spec = PathFinder.find_spec(".".join(parts[:i + 1]), search)
        if spec is not None and spec.origin is None and spec.submodule_search_locations:  # a namespace package
            search = spec.submodule_search_locations
            continue
        if spec is None or not spec.origin:
            raise InputError(f"the workload module {target} is not in the launch folder {layout.root}: on the "
                             "machine only that folder is on the import path. Plan from the folder that holds "
                             "the package, or name the file (path/to/file.py:function).")
        chain.append(Path(spec.origin))
        search = spec.submodule_search_locations
    for init in chain[:-1]:
        layout.place(init, "the workload's package")
    for sibling in sorted(chain[-1].parent.glob("*.py")):
        layout.place(sibling, "the workload module", found=sibling != chain[-1])


def place_params(params: dict, base_dir: str, layout: Layout, folder: str) -> dict:
    return {k: (_relative_to(layout.mount(resolve_path(v, base_dir), f"params.{k}"), folder)
                if k in FILE_PARAMS and isinstance(v, str) else v) for k, v in params.items()}


@dataclass
class Launch:
    order: dict  # order.json as the rented machine reads it
    spec_text: str | None  # order-campaign.yaml (None for the user's own loop: rentplan does not start it)
    order_path: str  # relative to the remote working folder
    spec_path: str | None
    layout: Layout


PRIVATE = (".ssh", ".aws", ".gnupg", ".config/gcloud", ".azure", ".kube", ".docker", ".netrc")


def workdir_problem(root: Path) -> str | None:
    """SkyPilot uploads the launch folder whole as the run's workdir: from a home folder (or one that holds keys
    and cloud credentials) it would carry them to the rented machine."""
    if root == Path.home().resolve():
        return f"the launch folder {root} is your home folder"
    held = [p for p in PRIVATE if (root / p).exists()]
    return f"the launch folder {root} holds {', '.join(held)}" if held else None


def launch_files(order: dict, spec_path: str, out_dir: str, root: str | None = None) -> Launch:
    """The order for the rented machine and the campaign spec it runs, with every file they name mounted."""
    layout = Layout(Path(os.path.abspath(root or os.getcwd())))
    why = workdir_problem(layout.root.resolve())
    if why:
        raise Unmountable(f"{why}: sky.yaml's workdir would upload it to the rented machine. Plan from your "
                          "project's folder")
    order_rel = layout.reserve(Path(out_dir) / "order.json", "the --out folder")
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
    spec_rel = layout.reserve(Path(out_dir) / SPEC_NAME, "the --out folder")
    data = load_yaml_file(spec, "campaign")
    data["workload"] = place_workload(data["workload"], base_dir, layout, folder)
    data["params"] = place_params(data.get("params") or {}, base_dir, layout, folder)
    text = ("# The campaign as ordered (written by rentplan plan from the spec named in order.json's provenance):\n"
            "# paths are relative to this file's folder on the rented machine.\n"
            + yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=1000))
    parse_campaign(yaml.safe_load(text), SPEC_NAME)  # what the run will load must load
    return Launch(machine_order, text, order_rel, spec_rel, layout)
