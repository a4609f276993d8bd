"""rentplan command line. Commands parse options, call one function, render. Torch is imported only
inside the commands that run a pilot, so planning, sheets and ledger commands work without torch.

    rentplan demo                       # pilot + plan + order sheet on built-in defaults
    rentplan probe --micro-batch 1,2,4 --seq-len 256,512 --precision fp32,bf16
    rentplan plan --campaign campaign.yaml --ledger rentplan.db --out rentplan-out
"""


from __future__ import annotations

import click

from planner import __version__
from planner.commands.campaign import archive, campaign, note
from planner.commands.checks import inspect, overfit, resume_check, split
from planner.commands.common import leave_with
from planner.commands.decide import (
    batch,
    demo,
    example_campaign_path,  # noqa: F401  (tests and the guide use it)
    plan,
    verify,
)
from planner.commands.measure import estimate, probe
from planner.commands.records import catalog, ledger
from planner.errors import sigterm_as_interrupt


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="rentplan")
def cli():
    """rentplan: pilot your training loop, then pick the GPU rental (which, how many, how long, what cost)."""



cli.add_command(probe)
cli.add_command(estimate)
cli.add_command(ledger)
cli.add_command(catalog)
cli.add_command(plan)
cli.add_command(demo)
cli.add_command(verify)
cli.add_command(batch)
cli.add_command(inspect)
cli.add_command(overfit)
cli.add_command(resume_check)
cli.add_command(split)
cli.add_command(campaign)
cli.add_command(archive)
cli.add_command(note)


def main() -> None:
    import signal

    signal.signal(signal.SIGTERM, sigterm_as_interrupt)  # the whole command, not only while it trains or probes
    try:
        cli()
    except SystemExit as e:
        leave_with(e.code)
        raise


if __name__ == "__main__":
    main()
