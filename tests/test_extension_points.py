"""One home per extension point (issue 46): each name known in several places lives in one table that the other
places read, and the builders cover that table."""

from click.testing import CliRunner

from planner.cli import cli
from planner.optimizers import OPTIMIZERS, TABLE, observed_name, optimizer_extra


def test_the_optimizer_builders_are_keyed_by_the_tables_names():
    from probes.loop import OPTIMIZER_BUILDERS

    assert list(OPTIMIZER_BUILDERS) == list(OPTIMIZERS)


def test_validation_help_observation_and_extras_read_the_optimizer_table():
    from planner.errors import InputError
    from planner.inputs.grid import GridSpec, build_grid
    from planner.outputs.orders import workload_extras

    help_text = CliRunner().invoke(cli, ["probe", "--help"], terminal_width=400).output
    for o in TABLE:
        assert o.name in help_text
        for alias in o.aliases:
            assert observed_name(alias) == o.name
        assert (optimizer_extra(o.name) in workload_extras("builtin:gpt", {}, o.name)) if o.extra else \
            workload_extras("builtin:gpt", {}, o.name) == ["probe"]
    try:
        build_grid(GridSpec(workload="builtin:gpt", optimizer=["nope"]))
    except InputError as e:
        assert ", ".join(OPTIMIZERS) in str(e)
    else:
        raise AssertionError("an optimizer outside the table was accepted")


def test_catalog_import_from_a_source_is_the_same_as_its_old_option(tmp_path):
    src = tmp_path / "vms.csv"
    src.write_text("InstanceType,AcceleratorName,AcceleratorCount,Price,Region,SpotPrice\n"
                   "gpu_1x_h100,H100,1,2.49,us-east-1,1.10\n")
    args = ["--provider", "sky", "--as-of", "2026-12-01"]
    new = CliRunner().invoke(cli, ["catalog", "import", "--from", "skypilot", str(src), *args])
    old = CliRunner().invoke(cli, ["catalog", "import", "--skypilot", str(src), *args])
    assert new.exit_code == old.exit_code == 0, new.output + old.output
    assert new.stdout == old.stdout and "h100_sxm" in new.stdout
    for bad in (["--from", "skypilot"], [str(src)], ["--skypilot", str(src), "--from", "skypilot", str(src)]):
        r = CliRunner().invoke(cli, ["catalog", "import", *bad, *args])
        assert r.exit_code == 2 and "Error:" in r.output, bad


def test_every_catalog_source_has_the_one_shape():
    import inspect

    from planner.inputs.sources import SOURCES

    for name, module in SOURCES.items():
        assert module.NAME == name and module.FILE
        assert list(inspect.signature(module.read).parameters) == ["path", "catalog", "provider", "as_of"]
