"""Every command that reads a file, fed generated YAML, CSV and JSON: valid, mutated and binary (issue 15).
Each must exit 0, or exit 1 with `Error:`; never a traceback, never a changed input file. Commands that would
train or probe on a valid input have their runner replaced by a stub: what is tested is the reading."""

import hashlib
import json
import os
import tempfile
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.cli import cli
from tests.factories import campaign_yaml, standard_ledger

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = int(os.environ.get("RENTPLAN_FUZZ_EXAMPLES", "30"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**30, 10**30), st.floats(allow_nan=True),
                    st.text(max_size=20))
structures = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                           st.dictionaries(st.text(max_size=12), inner, max_size=5)),
                          max_leaves=20)


def mutated(text: str):
    """A real file with a few characters deleted, replaced or inserted at generated positions."""
    @st.composite
    def build(draw):
        chars = list(text)
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, max(0, len(chars) - 1)))
            op = draw(st.sampled_from(["delete", "replace", "insert"]))
            c = draw(st.characters())
            if op == "delete" and chars:
                del chars[i]
            elif op == "replace" and chars:
                chars[i] = c
            else:
                chars.insert(i, c)
        return "".join(chars).encode("utf-8", "surrogatepass")
    return build()


def contents(valid_text: str, as_yaml: bool = True):
    generated = structures.map(lambda d: (yaml.safe_dump(d) if as_yaml else json.dumps(d)).encode())
    return st.one_of(st.just(valid_text.encode()), mutated(valid_text), generated, st.binary(max_size=300))


def run_on(path: Path, data: bytes, args: list[str]):
    path.write_bytes(data)
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    r = CliRunner().invoke(cli, args)
    assert r.exception is None or isinstance(r.exception, SystemExit), (args, repr(r.exception), data[:200])
    assert "Traceback" not in r.output
    assert r.exit_code in (0, 1), (r.exit_code, r.output)
    if r.exit_code == 1:
        assert "Error: " in r.output or "do not adopt" in r.output, r.output
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before, f"{args} changed its input"
    return r


@pytest.fixture(scope="module")
def ledger(tmp_path_factory):
    return standard_ledger(tmp_path_factory.mktemp("fuzz") / "l.db")


@pytest.fixture
def no_training(monkeypatch):
    """Valid generated specs must not start training or probing: only the reading is under test."""
    import probes.campaign
    import probes.runner

    monkeypatch.setattr(probes.campaign, "run_variant", lambda *a, **k: ("c-stub", "finished"))
    monkeypatch.setattr(probes.runner, "run_grid", lambda *a, **k: probes.runner.GridResult([], []))
    monkeypatch.setattr(probes.runner, "start_workers", lambda: None)


CAMPAIGN = campaign_yaml()
CATALOG = (ROOT / "catalog.yaml").read_text()[:6000].rsplit("\n  - id:", 1)[0] + "\n"
GRID = "workload: builtin:gpt\nparams: {layers: 1, d_model: 16, heads: 2, vocab: 32}\nmicro_batch: 1,2\nseq_len: 8\n"
SKYPILOT = ("InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,Price,SpotPrice,Region,GpuInfo\n"
            "gpu_1x_h100,H100,1,26,200,2.49,,us-east-1,\"{'Gpus': [{'MemoryInfo': {'SizeInMiB': 81920}}]}\"\n"
            "gpu_8x_a100,A100-80GB,8,124,1800,14.32,9.1,us-west-1,\n")
SPLIT = "patient,day,x\n" + "".join(f"{p},{d},{p * d}\n" for p in range(8) for d in range(5))


@FUZZ
@given(data=contents(CAMPAIGN))
def test_plan_reads_any_campaign_file(ledger, data):
    with tempfile.TemporaryDirectory() as d:
        run_on(Path(d) / "c.yaml", data, ["plan", "--campaign", str(Path(d) / "c.yaml"), "--ledger", ledger])


@FUZZ
@given(data=contents(CATALOG))
def test_catalog_validate_and_plan_read_any_catalog(ledger, data):
    with tempfile.TemporaryDirectory() as d:
        cat = Path(d) / "cat.yaml"
        v = run_on(cat, data, ["catalog", "validate", str(cat)])
        camp = Path(d) / "c.yaml"
        camp.write_text(CAMPAIGN)
        p = run_on(cat, data, ["plan", "--campaign", str(camp), "--catalog", str(cat), "--ledger", ledger])
        if v.exit_code == 1:  # one schema: what validate refuses, plan refuses too
            assert p.exit_code == 1


@FUZZ
@given(data=contents(GRID))
def test_probe_reads_any_grid_file(no_training, data):
    with tempfile.TemporaryDirectory() as d:
        run_on(Path(d) / "g.yaml", data, ["probe", "--grid", str(Path(d) / "g.yaml"), "--ledger",
                                          str(Path(d) / "l.db"), "--device", "cpu"])


@FUZZ
@given(data=contents(CAMPAIGN.replace("name: test-campaign", "name: test-campaign\nmicro_batch: 8")))
def test_campaign_run_reads_any_spec(no_training, data):
    with tempfile.TemporaryDirectory() as d:
        run_on(Path(d) / "c.yaml", data, ["campaign", "run", str(Path(d) / "c.yaml"), "--ledger",
                                          str(Path(d) / "l.db"), "--out", str(Path(d) / "runs"), "--device", "cpu"])


@FUZZ
@given(data=contents(SKYPILOT, as_yaml=False))
def test_catalog_import_reads_any_csv(data):
    with tempfile.TemporaryDirectory() as d:
        run_on(Path(d) / "vms.csv", data, ["catalog", "import", "--skypilot", str(Path(d) / "vms.csv"),
                                           "--provider", "p", "--as-of", "2026-12-01"])


@FUZZ
@given(data=contents(SPLIT, as_yaml=False))
def test_split_reads_any_csv(data):
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "d.csv"
        run_on(src, data, ["split", str(src), "--by", "patient", "--ratios", "0.5,0.5", "--out", str(Path(d) / "s")])
        run_on(src, data, ["split", "--check", str(src), str(src), "--by", "patient"])


@pytest.fixture(scope="module")
def order_text(tmp_path_factory):
    d = tmp_path_factory.mktemp("order")
    (d / "c.yaml").write_text(CAMPAIGN)
    r = CliRunner().invoke(cli, ["plan", "--campaign", str(d / "c.yaml"), "--ledger", standard_ledger(d / "l.db"),
                                 "--out", str(d / "out")])
    assert r.exit_code == 0, r.output
    return (d / "out" / "order.json").read_text()


def test_verify_reads_any_order(order_text):
    @FUZZ
    @given(data=contents(order_text, as_yaml=False))
    def check(data):
        with tempfile.TemporaryDirectory() as d:
            run_on(Path(d) / "order.json", data, ["verify", str(Path(d) / "order.json"), "--skip-pilot"])
    check()


MANIFEST = json.dumps({"format": "rentplan-archive/1", "run_id": "c-1",
                       "files": {"README.md": {"sha256": hashlib.sha256(b"hi\n").hexdigest(), "bytes": 3}}})


@FUZZ
@given(data=contents(MANIFEST, as_yaml=False))
def test_archive_verify_reads_any_manifest(data):
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "README.md").write_text("hi\n")
        run_on(Path(d) / "manifest.json", data, ["archive", "verify", d, "--ledger", os.devnull])


@FUZZ
@given(data=st.one_of(st.binary(max_size=2000), st.just(b"SQLite format 3\x00" + b"\x00" * 200)))
def test_ledger_show_reads_any_file(data):
    with tempfile.TemporaryDirectory() as d:
        run_on(Path(d) / "l.db", data, ["ledger", "show", "--ledger", str(Path(d) / "l.db")])
