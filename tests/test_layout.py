"""The code laid out like the product (issue 27): one command module per group, each short, and planner/ free of
probes/ outside the commands (planning works without torch; probes are reached only when a command runs one).

The planner's imports point one way (issue 46): each module sits on a floor, records, units, errors (the ground) <
models < inputs < decisions < outputs < tools < commands, and imports only from its own floor or below, at module
level and inside functions alike; and no import circle, in planner/ or in probes/. A function-level import is for a
heavy library (torch, pandas, matplotlib) or for probes/ from a command, never to hide a circle."""

import ast
from pathlib import Path

from planner.cli import cli

ROOT = Path(__file__).resolve().parent.parent / "planner"
PROBES = ROOT.parent / "probes"
FLOORS = ("ground", "models", "inputs", "decisions", "outputs", "tools", "commands")
# planner/'s own top-level modules: the records and what every floor shares (units, errors, the ledger and its file
# writes, input shapes, batch arithmetic, the optimizer table), and the CLI that assembles the commands
TOP_LEVEL = {"planner": "ground", "planner.records": "ground", "planner.catalog_records": "ground",
             "planner.units": "ground", "planner.errors": "ground", "planner.storage": "ground",
             "planner.ledger": "ground", "planner.shapes": "ground", "planner.batching": "ground",
             "planner.optimizers": "ground",
             "planner.api": "commands", "planner.cli": "commands", "planner.__main__": "commands"}
GROUPS = {"measure": {"probe", "estimate"}, "records": {"ledger", "catalog"},
          "decide": {"plan", "demo", "verify", "batch"}, "checks": {"inspect", "overfit", "resume-check", "split"},
          "campaign": {"campaign", "archive", "note"}}


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(path: Path, packages=("planner", "probes"), text: str | None = None) -> list[tuple[str, int]]:
    """(module, line) of every import of the project's own modules in a file, at module level or inside a function;
    relative imports resolved, and `from package import submodule` counted as the submodule."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text() if text is None else text)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base for a in node.names]
        else:
            continue
        found += [(t, node.lineno) for t in targets if t.split(".")[0] in packages]
    return found


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (ROOT.parent / rel).with_suffix(".py").is_file() or (ROOT.parent / rel / "__init__.py").is_file()


def floor_of(module: str) -> str:
    if module in TOP_LEVEL:
        return TOP_LEVEL[module]
    parts = module.split(".")
    assert parts[0] == "planner" and len(parts) > 1 and parts[1] in FLOORS, \
        f"{module}: not on a floor (a planner/ module lives in one of {FLOORS[1:]}, or is named in TOP_LEVEL)"
    return parts[1]


def graph(root: Path, package: str) -> dict[str, set[str]]:
    return {module_name(p): {t for t, _ in project_imports(p, (package,))} for p in root.rglob("*.py")}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), and every module that imports itself."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on.discard(group[-1])
            if len(group) > 1 or v in edges.get(v, ()):
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_planner_imports_only_from_its_own_floor_or_below():
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        mod = module_name(path)
        here = FLOORS.index(floor_of(mod))
        for target, line in project_imports(path, ("planner",)):
            if FLOORS.index(floor_of(target)) > here:
                upward.append(f"{path.relative_to(ROOT.parent)}:{line} ({floor_of(mod)}) imports {target} "
                              f"({floor_of(target)})")
    assert upward == []


def test_the_floor_check_sees_imports_inside_functions_and_relative_ones():
    text = "import os\n\ndef f():\n    from planner.commands.common import progress\n    from ..outputs import orders\n"
    found = project_imports(ROOT / "models" / "kernels.py", ("planner",), text)
    assert [t for t, _ in found] == ["planner.commands.common", "planner.outputs.orders"]
    assert all(FLOORS.index(floor_of(t)) > FLOORS.index("models") for t, _ in found)


def test_no_import_circle_in_planner_or_probes():
    assert circles(graph(ROOT, "planner")) == []
    assert circles(graph(PROBES, "probes")) == []
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check sees one


def test_planner_reaches_probes_only_from_its_commands():
    offenders = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
                 if "commands" not in p.parts and any(m == "probes" or m.startswith("probes.")
                                                      for m in imported_modules(p))]
    assert offenders == []


def test_each_group_of_commands_has_its_own_short_module():
    for module, commands in GROUPS.items():
        path = ROOT / "commands" / f"{module}.py"
        assert len(path.read_text().splitlines()) < 300, path
        for name in commands:
            assert cli.commands[name].callback.__module__ == f"planner.commands.{module}", name
    assert set(cli.commands) == set().union(*GROUPS.values())  # every command belongs to a group
    assert len((ROOT / "cli.py").read_text().splitlines()) < 80
