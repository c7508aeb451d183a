"""The plan wing: from a request's ops to a frozen plan of partitions.

    analyse.py    the ops a request needs, as an immutable GraphView
    optypes.py    the op tables: what must be fed, what is state, what only reads shapes
    units.py      groups of ops that must run in one partition
    partition.py  a depth-first order of the units, sliced into partitions (and their size)
    gc_pause.py   planning with Python's cyclic collector held off
    swap.py       the swap policy and the transfer spans
    schedule.py   what every step does with the transfers, worked out once
    streams.py    which random streams a plan draws from
    place.py      where state lives (the plan's Placement)
    updates.py    a step's state updates gathered into its last partition
    build.py      the Plan value, `build_plan`, `make_plan` and `validate`

Pure: it builds frozen values from a graph and runs no TensorFlow kernel.
It imports nothing from the other wings (memory, run, cli).  The plan's
names are served here too (`from tfmem.plan import make_plan`), imported on
first use.
"""

import importlib

_PLAN_NAMES = ("Plan", "Partition", "Transfer", "build_plan", "make_plan", "validate")


def __getattr__(name):
    if name in _PLAN_NAMES:
        return getattr(importlib.import_module("tfmem.plan.build"), name)
    raise AttributeError(f"module 'tfmem.plan' has no attribute {name!r}")
