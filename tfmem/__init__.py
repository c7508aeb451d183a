"""tfmem: train TensorFlow graph-mode models larger than accelerator memory.

A request is analysed, cut into partitions of at most `partition_size` ops,
planned, copied into the session's graph and executed one partition per
`Session.run`.  Importing tfmem changes no TensorFlow state.
"""

from tfmem.errors import InvalidPlanError, TFMemError, UnsupportedGraphError
from tfmem.plan import Partition, Plan, Residency, Transfer, validate
from tfmem.session import TFMemSession

__all__ = [
    "InvalidPlanError", "Partition", "Plan", "Residency", "TFMemError",
    "TFMemSession", "Transfer", "UnsupportedGraphError", "validate",
]
