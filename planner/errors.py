"""One exception family for expected failures; the CLI turns each into `Error: ...` and exit 1. And the one
SIGTERM handler, which turns a preemption into the interrupt the CLI reports as Ctrl-C's."""


class RentplanError(Exception):
    """An expected failure whose message says what went wrong and what to do next."""


class InputError(RentplanError):
    """Bad YAML, bad options, a file that cannot be read."""


class CatalogError(InputError):
    pass


class CampaignError(InputError):
    pass


class LedgerError(RentplanError):
    pass


class WorkloadError(RentplanError):
    pass


class NoFeasibleGpu(RentplanError):
    pass


def sigterm_as_interrupt(signum, frame):
    """SIGTERM (a spot machine's preemption, a cancelled job) handled as Ctrl-C: what is in flight is marked
    interrupted and the command says "Interrupted" and exits 130. planner/cli.main sets it for the whole command;
    the pilot, the search and a campaign set it while they run for callers of the Python API."""
    raise KeyboardInterrupt
