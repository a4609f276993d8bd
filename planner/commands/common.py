"""What every command shares: options, the device and grid from options, progress, and errors as `Error: ...`."""

from __future__ import annotations

import errno
import functools
import os
import shutil
import signal
import sys
import threading
import time

import click

from planner.errors import RentplanError
from planner.inputs.grid import GridSpec
from planner.optimizers import optimizer_help
from planner.outputs.tables import FORMATS
from planner.storage import WriteError


def resolve_device(device: str, ranks: int = 1) -> str:
    """auto | cpu | cuda | cuda:N, as probes.api.device checks it (only the commands that run pilots get here)."""
    from probes.api import device as checked

    return checked(device, ranks)


def spec_from_options(opts: dict) -> GridSpec:
    """The grid the options and the --grid file describe, on a device this machine has (probes.api.grid)."""
    from probes.api import grid

    return grid(**opts)


INTERRUPTED = 130  # Ctrl-C's exit status (128 + SIGINT), SIGTERM's too
EXIT_WATCHDOG_S = 10.0  # a command's exit (atexit handlers, joins) is cut off after this long


def progress(msg: str) -> None:
    click.echo(msg, err=True)


def friendly_errors(fn):
    """Expected failures become `Error: ...` and exit 1; Ctrl-C (or SIGTERM) exits 130 with a note."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RentplanError as e:
            raise click.ClickException(str(e)) from None
        except UnicodeDecodeError as e:  # a file read as text that is not UTF-8
            raise click.ClickException(f"a file is not UTF-8 text ({e.reason} at byte {e.start}); save it as "
                                       "UTF-8 and run again.") from None
        except OSError as e:  # unreadable input, unwritable output folder, disk full
            if isinstance(e, shutil.Error) and e.args and isinstance(e.args[0], list) and e.args[0]:
                src, dst, why = e.args[0][0]  # copytree's list of (source, destination, reason): the first says it
                e = OSError(errno.ENOSPC if "No space" in str(why) else None, str(why), None, None, str(dst))
            where = f"{e.filename}: " if e.filename else ""
            if e.errno in (errno.ENOSPC, errno.EDQUOT):  # the disk's fault: name the file written, never one read
                written = e.filename2 or (e.filename if isinstance(e, WriteError) else None)
                raise click.ClickException(f"{e.strerror} while writing{' ' + written if written else ''}: free "
                                           "space on that disk or write elsewhere (--out / --to / --ledger), then "
                                           "run the same command again.") from None
            if e.errno == errno.EROFS:
                raise click.ClickException(f"{where}is on a read-only file system: write elsewhere (--out / --to / "
                                           "--ledger), then run the same command again.") from None
            raise click.ClickException(f"{where}{e.strerror or e}. Check the path and its permissions "
                                       "(nothing was changed)." if not isinstance(e, IsADirectoryError) else
                                       f"{where}is a folder; a file was expected.") from None
        except KeyboardInterrupt:
            click.echo("Interrupted: every line written so far is in the ledger; rerun the same command to "
                       "continue where it stopped.", err=True)
            sys.exit(INTERRUPTED)  # planner/cli.main makes sure the process leaves with it (leave_with)

    return wrapper


def leave_with(code) -> None:
    """The process leaves with the exit status its command chose (`code`, as SystemExit holds it), whatever arrives
    while it tears down. Called by the process's own entry point (planner/cli.main), never in a CliRunner.
    - A Ctrl-C or SIGTERM in that half second (torch's teardown; after a summary, or a second one after
      "Interrupted") killed it by that signal (-2, -15) or printed torch's atexit traceback: Python puts the default
      handlers back before the teardown (Modules/signalmodule.c, _PySignal_Fini, which keeps an ignored signal
      ignored). Both are ignored from here; a watchdog ends an exit that hangs.
    - An interrupt that left code run by exec() (dataclasses, namedtuple and torch make such code as they import)
      sets a process-wide flag that only the next exec() of a string clears (Python/pythonrun.c,
      run_eval_code_obj); under `python -m` (torchrun, tests) the process was then killed by SIGINT at exit
      whatever it caught (Modules/main.c, Py_RunMain -> exit_sigint)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # first: an interrupt now would escape the entry point
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    status = code if isinstance(code, int) else (0 if code is None else 1)  # sys.exit("text") prints it, exits 1
    exec("None")

    def watchdog():
        time.sleep(EXIT_WATCHDOG_S)
        os._exit(status)

    threading.Thread(target=watchdog, name="rentplan-exit-watchdog", daemon=True).start()


def format_option(fn):
    return click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True,
                        help="table/markdown for people, csv/json for machines.")(fn)


def ledger_option(fn):
    return click.option("--ledger", "ledger_path", default="rentplan.db", show_default=True,
                        type=click.Path(dir_okay=False), help="SQLite ledger file.")(fn)



def grid_options(fn):
    opts = [
        click.option("--workload", "-w", default=None,
                     help="builtin:gpt | builtin:classifier | file.py:fn | module:fn | hf:CONFIG_DIR | script:NAME "
                          "(with --script)"),
        click.option("--param", "-p", "params", multiple=True, help="workload parameter key=value (repeatable)."),
        click.option("--micro-batch", default=None, help="comma list, e.g. 1,2,4"),
        click.option("--seq-len", default=None, help="comma list, e.g. 256,512"),
        click.option("--eval-seq-len", default=None, help="comma list; default: each seq-len"),
        click.option("--eval-micro-batch", default=None, type=int, help="default: the micro-batch"),
        click.option("--precision", default=None,
                     help="comma list of fp32 (32-true), bf16 (bf16-mixed), fp16 (16-mixed), bf16-true, 16-true"),
        click.option("--checkpointing", default=None, help="comma list of off,on"),
        click.option("--optimizer", default=None, help=optimizer_help()),
        click.option("--grad-accum", default=None, help="comma list"),
        click.option("--effective-batch", default=None, type=int,
                     help="examples per update; sets grad-accum = N / micro-batch"),
        click.option("--steady-updates", default=None, type=int, help="timed updates after the first (>= 3)"),
        click.option("--lr", default=None, type=float),
        click.option("--cap", default=None, help="cap memory at a catalog GPU's usable memory (GPU id) or a size"),
        click.option("--catalog", "catalog_path", default=None, type=click.Path(dir_okay=False)),
        click.option("--device", default=None, help="auto | cpu | cuda | cuda:N (default: a --grid file's, else auto)"),
        click.option("--strategy", default=None, help="single | ddp | fsdp (FSDP2 fully_shard per block)"),
        click.option("--nproc", default=None, type=int, help="ranks on this machine, started by torch's launcher"),
        click.option("--grid", "grid_file", default=None, type=click.Path(dir_okay=False),
                     help="probe YAML file with the same keys as these options"),
        click.option("--lora", default=None, help="hf: workloads: r=16,alpha=32,targets=q_proj+v_proj"),
        click.option("--quantize", default=None, type=click.Choice(["nf4", "fp4", "int8"]),
                     help="hf: workloads with --lora: the base's linears in 4 or 8 bits (QLoRA, bitsandbytes)"),
        click.option("--data", default=None, type=click.Path(),
                     help="hf: workloads: your JSONL (or a split folder); its p99/longest lengths set the lengths"),
        click.option("--fields", default=None, help="hf: workloads: prompt,response | text | text,label"),
        click.option("--val-data", default=None, type=click.Path(dir_okay=False),
                     help="hf: workloads: validation JSONL (else --data may be a folder from `rentplan split`)"),
        click.option("--on-truncate", default=None, type=click.Choice(["warn", "drop", "error"]),
                     help="hf: workloads: examples longer than seq_len are counted and trained on cut (warn), "
                          "left out (drop), or refused (error)"),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def catalog_path_option(fn):
    return click.option("--catalog", "catalog_path", default=None, type=click.Path(dir_okay=False),
                        help="default: the bundled catalog.yaml")(fn)


def workload_options(fn):
    fn = click.option("--param", "-p", "params", multiple=True, help="workload parameter key=value")(fn)
    return click.option("--workload", "-w", default="builtin:gpt", show_default=True,
                        help="builtin:gpt | builtin:classifier | file.py:fn | module:fn | hf:CONFIG_DIR")(fn)
