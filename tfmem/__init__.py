"""tfmem: train TensorFlow graph-mode models larger than accelerator memory.

A request is analysed, cut into partitions of at most `partition_size` ops,
planned, copied into the session's graph and executed one partition per
`Session.run`.  Importing tfmem imports nothing from TensorFlow until a name
is used (so `tfmem.emulate_accelerator` can still configure TensorFlow's
allocator), and changes no TensorFlow state.
"""

import importlib

_EXPORTS = {
    "TFMemSession": "tfmem.session",
    "Plan": "tfmem.plan", "Partition": "tfmem.plan", "Transfer": "tfmem.plan",
    "validate": "tfmem.plan", "SwapPolicy": "tfmem.swap", "Span": "tfmem.swap",
    "StepStats": "tfmem.stats", "emulate_accelerator": "tfmem.accelerator",
    "Placement": "tfmem.place", "place": "tfmem.place", "state_on_host": "tfmem.place",
    "TFMemError": "tfmem.errors", "InvalidPlanError": "tfmem.errors",
    "UnsupportedGraphError": "tfmem.errors", "BudgetError": "tfmem.errors",
    "HostMemoryError": "tfmem.errors", "DeviceMemoryError": "tfmem.errors",
    "MemoryReport": "tfmem.session",
    "parse_bytes": "tfmem.budget",
    "Session": "tfmem.session_factory", "session_config": "tfmem.session_factory",
    "CompileStats": "tfmem.compile_stats",
    "RemoteTaskError": "tfmem.remote",
    "function": "tfmem.tf2.function", "PartitionedFunction": "tfmem.tf2.function",
    "SessionCreator": "tfmem.monitored", "MonitoredSession": "tfmem.monitored",
    "MonitoredTrainingSession": "tfmem.monitored",
    "SingularMonitoredSession": "tfmem.monitored",
}
# Submodules exported by name (imported on first use): tfmem.keras.
_MODULES = {"keras": "tfmem.keras"}

__all__ = sorted(list(_EXPORTS) + list(_MODULES))


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    raise AttributeError(f"module 'tfmem' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
