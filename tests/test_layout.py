"""The code laid out like the product (issue 27): one command module per group, each short, and planner/ free of
probes/ outside the commands (planning works without torch; probes are reached only when a command runs one)."""

import ast
from pathlib import Path


from planner.cli import cli

ROOT = Path(__file__).resolve().parent.parent / "planner"
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
