"""`rentplan probe --script`: a plain PyTorch script, run as it is, gets phase lines from hooks; OOM under a cap
and a timeout are verdicts on lines; `plan` uses a complete run like a probe's."""

import json
import os

import pytest
from click.testing import CliRunner

from planner.cli import cli
from planner.ledger import read_lines

pytest.importorskip("torch")

SCRIPT = '''"""A plain loop: accumulation 2, eval on longer sequences, a checkpoint, a safetensors export."""
import argparse, time
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=6)
p.add_argument("--hang-after", type=int, default=-1)
a = p.parse_args()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(256, 64), torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True),
                            torch.nn.Linear(64, 256))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data, val = torch.randint(0, 256, (64, 33)), torch.randint(0, 256, (8, 49))
for step in range(a.steps):
    for micro in range(2):
        ids = data[(step * 2 + micro) * 4 % 64:][:4]
        loss = F.cross_entropy(model(ids[:, :-1]).reshape(-1, 256), ids[:, 1:].reshape(-1)) / 2
        loss.backward()
    opt.step()
    opt.zero_grad()
    if step == a.hang_after:
        time.sleep(600)
    if step == 2:
        model.eval()
        with torch.no_grad():
            F.cross_entropy(model(val[:4, :-1]).reshape(-1, 256), val[:4, 1:].reshape(-1))
        model.train()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, "ckpt.pt")
save_file({k: v.contiguous() for k, v in model.state_dict().items()}, "model.safetensors")
'''

SPEC = """name: plain
workload: script:train
precision: fp32
optimizer: adamw
seq_len: 32
effective_batch: 8
updates: 500
eval: {every_updates: 100, examples: 64, seq_len: 48}
setup_hours: 0.5
variants:
  - {id: control, lr: 1.0e-3, priority: 1}
"""


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(SCRIPT)
    return tmp_path / "train.py"


def probe(*args):
    return CliRunner().invoke(cli, ["probe", "--script", "train.py", "--ledger", "l.db", *args])


@pytest.mark.slow
def test_plain_script_gets_phase_lines_that_plan_uses(script, tmp_path):
    r = probe("--steady-updates", "3", "--", "--steps", "6")
    assert r.exit_code == 0, r.output
    lines = read_lines(tmp_path / "l.db")
    by = lines.set_index("phase")
    assert set(lines["phase"]) == {"setup", "first_step", "steady", "eval", "save", "export"}
    assert (lines["verdict"] == "ok").all() and set(lines["source"]) == {"script"}
    assert set(lines["workload"]) == {"script:train"}
    first = by.loc["first_step"]
    # Found by the hooks: the model's calls (4 × 32, twice per step), its optimizer, fp32 (no autocast).
    assert (first["micro_batch"], first["seq_len"], first["grad_accum"], first["optimizer"], first["precision"]) == (
        4, 32, 2, "adamw", "fp32")
    assert by.loc["eval", "eval_seq_len"] == 48
    assert by.loc["save", "checkpoint_bytes"] == os.path.getsize(tmp_path / "ckpt.pt")
    assert by.loc["export", "checkpoint_bytes"] == os.path.getsize(tmp_path / "model.safetensors")
    assert len(json.loads(by.loc["steady", "update_times_s"])) == 3
    assert 4.5 < first["loss_first"] < 6.5  # the backpropagated losses of the window, summed
    (tmp_path / "c.yaml").write_text(SPEC)
    r = CliRunner().invoke(cli, ["plan", "--campaign", "c.yaml", "--ledger", "l.db", "--format", "json"])
    assert r.exit_code == 0, r.output
    assert "user's own loop (script)" in r.output


@pytest.mark.slow
def test_script_oom_under_a_cap_is_an_oom_line(script, tmp_path):
    r = probe("--cap", "1MiB")
    assert r.exit_code == 1 and "Error: the script failed: OutOfMemoryError" in r.output
    assert "Traceback" not in r.output
    lines = read_lines(tmp_path / "l.db")
    assert list(lines["phase"]) == ["setup", "first_step"] and list(lines["verdict"]) == ["ok", "oom"]


@pytest.mark.slow
def test_script_that_hangs_gets_a_timeout_line(script, tmp_path):
    r = probe("--timeout", "10", "--", "--hang-after", "0")
    assert r.exit_code == 1 and "timed out" in r.output
    lines = read_lines(tmp_path / "l.db")
    assert list(lines["verdict"]) == ["ok", "ok", "timeout"]
    assert lines["phase"].iloc[-1] == "steady" and "inferred" in lines["detail"].iloc[-1]


def test_script_options_that_the_script_decides_are_refused(script, tmp_path):
    r = probe("--micro-batch", "4")
    assert r.exit_code == 1 and "Error: --micro-batch: with --script" in r.output
    r = CliRunner().invoke(cli, ["probe", "--ledger", "l.db", "stray"])
    assert r.exit_code == 1 and "arguments after -- go to a --script" in r.output
    r = probe("-w", "script:../x")
    assert r.exit_code == 1 and "script:NAME" in r.output
    assert not (tmp_path / "l.db").exists()


UNET_SCRIPT = '''"""A UNet-style denoiser trained as a plain script: one process, micro-batch 8, accumulation 2."""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class UNet(nn.Module):
    def __init__(self, c=16):
        super().__init__()
        self.down = nn.Conv2d(3, c, 3, padding=1)
        self.mid = nn.Conv2d(c, c, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(c, c, 2, stride=2)
        self.out = nn.Conv2d(2 * c, 3, 3, padding=1)

    def forward(self, x):
        d = F.relu(self.down(x))
        return self.out(torch.cat([d, F.relu(self.up(F.relu(self.mid(d))))], 1))


model = UNet()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
clean = torch.rand(64, 3, 64, 64)
for step in range(6):
    for micro in range(2):
        x = clean[(step * 2 + micro) * 8 % 64:][:8]
        loss = F.mse_loss(model(x + 0.1 * torch.randn_like(x)), x) / 2
        loss.backward()
    opt.step()
    opt.zero_grad()
    if step == 2:
        model.eval()
        with torch.no_grad():
            F.mse_loss(model(clean[:8]), clean[:8])
        model.train()
torch.save(model.state_dict(), "unet.pt")
'''

UNET_SPEC = """name: unet-b
workload: script:unet-denoiser-b
precision: fp32
effective_batch: 16
updates: 2000
eval: {every_updates: 500, examples: 64, seq_len: 4096}   # positions per example: the 64×64 images' H×W
setup_hours: 0.5
variants:
  - {id: control, lr: 1.0e-3}
"""


@pytest.mark.slow
def test_a_single_process_script_is_never_ordered_as_ddp(tmp_path, monkeypatch):
    """User (#44): `probe --script train_unet_b.py -w script:unet-denoiser-b` recorded world size 1, then `plan`
    recommended RTX 3090 × 2 as "ddp × 2", priced at the two-replica time, and sky.yaml asked for 2 GPUs. The
    script cannot run DDP: rentplan cannot make the user's loop data-parallel."""
    import yaml

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train_unet_b.py").write_text(UNET_SCRIPT)
    (tmp_path / "unet.yaml").write_text(UNET_SPEC)
    r = CliRunner().invoke(cli, ["probe", "--script", "train_unet_b.py", "-w", "script:unet-denoiser-b",
                                 "--ledger", "l.db"])
    assert r.exit_code == 0, r.output
    assert set(read_lines(tmp_path / "l.db")["world_size"]) == {1}
    r = CliRunner().invoke(cli, ["plan", "--campaign", "unet.yaml", "--ledger", "l.db", "--out", "unet-out"])
    assert r.exit_code == 0, r.output
    import pandas as pd

    sheet = pd.read_csv(tmp_path / "unet-out" / "selection.csv")
    assert set(sheet["strategy"]) == {"single"} and set(sheet["replicas"]) == {1}
    two = sheet[sheet["offer"] == "vast-rtx_3090-2x"].iloc[0]
    assert "needs your loop to run DDP" in two["strategy_label"] and two["idle_gpus"] == 1
    rec = sheet[sheet["recommended"]].iloc[0]
    assert rec["gpus_per_instance"] == 1
    order = json.loads((tmp_path / "unet-out" / "order.json").read_text())
    assert order["offer"]["gpus_per_instance"] == 1 and order["settings"]["replicas"] == 1
    sky = yaml.safe_load((tmp_path / "unet-out" / "sky.yaml").read_text())
    assert sky["resources"]["accelerators"].endswith(":1")
    # ordering the two-GPU offer by name is refused: the script would leave a GPU idle that is paid for
    r = CliRunner().invoke(cli, ["plan", "--campaign", "unet.yaml", "--ledger", "l.db", "--out", "o2",
                                 "--offer", "vast-rtx_3090-2x"])
    assert r.exit_code == 1 and "Error: " in r.output and "needs your loop to run DDP" in r.output, r.output
    assert "Traceback" not in r.output and not (tmp_path / "o2").exists()


EVAL_THEN_SAVE = (
    '"""The loop as people write it: evaluate, checkpoint, and switch back to training at the next step."""\n'
    '''import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(128, 32), torch.nn.Linear(32, 128))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data, val = torch.randint(0, 128, (64, 17)), torch.randint(0, 128, (8, 25))
for step in range(8):
    model.train()
    ids = data[step * 4 % 64:][:4]
    F.cross_entropy(model(ids[:, :-1]).reshape(-1, 128), ids[:, 1:].reshape(-1)).backward()
    opt.step()
    opt.zero_grad()
    if step % 4 == 3:
        model.eval()
        with torch.no_grad():
            F.cross_entropy(model(val[:, :-1]).reshape(-1, 128), val[:, 1:].reshape(-1))
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, "ckpt.pt")
''')


@pytest.mark.slow
def test_eval_then_save_then_train_at_the_next_step_keeps_both_phases(tmp_path, monkeypatch):
    """User (#44): a script that evaluates, then torch.save()s, then calls model.train() at the next step got no eval
    line, the note "the script never called model.eval()", and a plan that pointed at `ledger show --verdict oom`."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(EVAL_THEN_SAVE)
    r = probe("-w", "script:eval-save", "--steady-updates", "3")
    assert r.exit_code == 0, r.output
    assert "never called model.eval()" not in r.output
    lines = read_lines(tmp_path / "l.db")
    by = lines.set_index("phase")
    assert set(lines["phase"]) == {"setup", "first_step", "steady", "eval", "save"}
    assert (lines["verdict"] == "ok").all()
    assert (by.loc["eval", "eval_micro_batch"], by.loc["eval", "eval_seq_len"]) == (8, 24)  # the eval pass's shape
    assert by.loc["save", "checkpoint_bytes"] == os.path.getsize(tmp_path / "ckpt.pt")
    # eval, then save, then train: the save is not inside eval's time, and eval's peak holds its own pass
    assert by.loc["eval", "peak_allocated_bytes"] >= by.loc["eval", "baseline_allocated_bytes"] + 8 * 24 * 128 * 4
    (tmp_path / "c.yaml").write_text(SPEC.replace("script:train", "script:eval-save")
                                     .replace("seq_len: 32", "seq_len: 16")
                                     .replace("seq_len: 48", "seq_len: 24"))
    r = CliRunner().invoke(cli, ["plan", "--campaign", "c.yaml", "--ledger", "l.db", "--format", "json"])
    assert r.exit_code == 0, r.output


@pytest.mark.slow
def test_plan_names_the_real_reason_a_script_run_is_incomplete(tmp_path, monkeypatch):
    """User (#44): nothing ran out of memory, yet `plan` said "no complete run ... see `ledger show --verdict oom`".
    A script that never evaluates: the plan says its run has no eval line, and why, not oom."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(EVAL_THEN_SAVE.replace("if step % 4 == 3:", "if False:"))
    r = probe("-w", "script:eval-save", "--steady-updates", "3")
    assert r.exit_code == 0, r.output
    (tmp_path / "c.yaml").write_text(SPEC.replace("script:train", "script:eval-save"))
    r = CliRunner().invoke(cli, ["plan", "--campaign", "c.yaml", "--ledger", "l.db"])
    assert r.exit_code == 1 and "Traceback" not in r.output
    run_id = read_lines(tmp_path / "l.db")["run_id"].iloc[0]
    assert "Error: no complete run to plan from" in r.output
    assert f"run {run_id} (script) has no eval line" in r.output and "model.eval()" in r.output
    assert "oom" not in r.output


def test_a_model_call_is_read_by_role():
    """The hook's reading of a model call: token ids before anything else; an NCHW image's channels are no sequence."""
    import torch

    from probes.observe import batch_shape

    image, t = torch.rand(8, 3, 32, 32), torch.rand(8)  # a denoiser's call: images and a 1-D timestep
    assert batch_shape((image, t), {}).text == "image 8×3×32×32"
    assert batch_shape((), {"pixel_values": image, "labels": torch.randint(0, 9, (8,))}).positions == 1024
    ids = torch.randint(0, 100, (4, 32))
    assert batch_shape((), {"input_ids": ids, "attention_mask": torch.ones(4, 32)}).text == "tokens 4×32"
    assert batch_shape((torch.rand(4, 50, 80),), {}).text == "sequence 4×50×80"
    assert batch_shape((torch.rand(8),), {}) is None


UNET_B = '''"""A UNet-style denoiser on 32×32 RGB images: micro-batch 8, accumulation 2; evaluate, then save."""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class UNet(nn.Module):
    def __init__(self, c=32):
        super().__init__()
        self.down1 = nn.Conv2d(3, c, 3, padding=1)
        self.down2 = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1)
        self.mid = nn.Conv2d(2 * c, 2 * c, 3, padding=1)
        self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.out = nn.Conv2d(2 * c, 3, 3, padding=1)

    def forward(self, x):
        d1 = F.relu(self.down1(x))
        m = F.relu(self.mid(F.relu(self.down2(d1))))
        return self.out(torch.cat([d1, F.relu(self.up(m))], 1))


model = UNet()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
images, val = torch.rand(128, 3, 32, 32), torch.rand(16, 3, 32, 32)
for step in range(8):
    model.train()
    for micro in range(2):
        x = images[(step * 2 + micro) * 8 % 128:][:8]
        loss = F.mse_loss(model(x + 0.1 * torch.randn_like(x)), x) / 2
        loss.backward()
    opt.step()
    opt.zero_grad()
    if step % 4 == 3:
        model.eval()
        with torch.no_grad():
            F.mse_loss(model(val[:8] + 0.1 * torch.randn_like(val[:8])), val[:8])
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, "ckpt.pt")
'''

UNET_B_SPEC = """name: unet-b
workload: script:unet-denoiser-b
precision: fp32
seq_len: {side}
effective_batch: 16
micro_batch: 8
updates: 2000
eval: {{every_updates: 500, examples: 64, seq_len: {side}}}
setup_hours: 0.5
variants:
  - {{id: control, lr: 1.0e-3}}
"""


@pytest.mark.slow
def test_an_image_scripts_channels_are_not_its_sequence(tmp_path, monkeypatch):
    """User (#44): `probe --script train_unet_b.py -w script:unet-denoiser-b` of a denoiser on 8×3×32×32 images
    recorded the 3 channels as seq_len (`mb8×3`); with `seq_len: 32` in the spec the plan showed ~10× the measured
    memory at micro-batch 8, and "max seq" for an image model."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train_unet_b.py").write_text(UNET_B)
    r = CliRunner().invoke(cli, ["probe", "--script", "train_unet_b.py", "-w", "script:unet-denoiser-b",
                                 "--ledger", "l.db", "--steady-updates", "3"])
    assert r.exit_code == 0, r.output
    assert "image 8×3×32×32" in r.output and "mb8×3 " not in r.output
    lines = read_lines(tmp_path / "l.db")
    by = lines.set_index("phase")
    assert set(lines["input_shape"]) == {"image 8×3×32×32"}  # what was read, on every line
    first = by.loc["first_step"]
    assert (first["micro_batch"], first["seq_len"], first["grad_accum"]) == (8, 32 * 32, 2)  # H×W, not channels
    assert (by.loc["eval", "eval_micro_batch"], by.loc["eval", "eval_seq_len"]) == (8, 1024)
    # The image side, as a user writes it: refused, naming both and what to write.
    (tmp_path / "side.yaml").write_text(UNET_B_SPEC.format(side=32))
    r = CliRunner().invoke(cli, ["plan", "--campaign", "side.yaml", "--ledger", "l.db"])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "seq_len 32" in r.output and "image 8×3×32×32" in r.output and "write `seq_len: 1024`" in r.output
    # Positions per example, as the README says: the plan at micro-batch 8 is what the probe measured.
    (tmp_path / "unet.yaml").write_text(UNET_B_SPEC.format(side=1024))
    r = CliRunner().invoke(cli, ["plan", "--campaign", "unet.yaml", "--ledger", "l.db", "--out", "out"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    import pandas as pd

    sheet = pd.read_csv(tmp_path / "out" / "selection.csv")
    assert set(sheet["micro_batch"]) == {8}
    measured = lines["simulated_reserved_bytes"].max()  # the largest phase's reserved peak, CUDA's allocator model
    assert (sheet["need_bytes"] == measured).all(), (sheet["need_bytes"].iloc[0], measured)
    assert "measured at this configuration" in sheet["need_basis"].iloc[0]
    md = (tmp_path / "out" / "order_sheet.md").read_text()
    for text in (r.output, md, (tmp_path / "out" / "order_sheet.html").read_text()):
        assert "max seq" not in text and "max_seq" not in text
    assert "1,024 positions (32×32) per example" in md
