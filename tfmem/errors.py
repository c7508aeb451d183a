"""The exception hierarchy: every error tfmem raises itself derives from TFMemError.

Mistakes in a request (a bad fetch, a feed of the wrong shape, an unfed
placeholder) raise what `Session.run` raises for the same request, so that a
wrapped session fails exactly like a plain one.  TFMemError is for what only
tfmem can get wrong: a graph it cannot partition or a plan that breaks an
invariant.
"""


class TFMemError(Exception):
    """Base class of tfmem's own errors."""


class UnsupportedGraphError(TFMemError):
    """The request reaches a graph construct tfmem cannot run in partitions."""


class InvalidPlanError(TFMemError):
    """A plan breaks one of the invariants checked by `tfmem.validate`."""


class BudgetError(TFMemError):
    """No plan fits the device-memory budget, even with one op per partition."""


class HostMemoryError(TFMemError):
    """The plan needs more host memory for swapped tensors than the machine has free."""
