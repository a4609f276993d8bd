"""One exception family for expected failures; the CLI turns each into `Error: ...` and exit 1."""


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
