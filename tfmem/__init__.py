"""tfmem: train TensorFlow graph-mode models larger than accelerator memory.

A request is analysed, cut into partitions of at most `partition_size` ops,
planned, copied into the session's graph and executed one partition per
`Session.run`.  Importing tfmem imports nothing from TensorFlow until a name
is used (so `tfmem.emulate_accelerator` can still configure TensorFlow's
allocator), and changes no TensorFlow state.
"""

import importlib

_EXPORTS = {
    "TFMemSession": "tfmem.run.front_end.session", "Options": "tfmem.run.front_end.options",
    "Plan": "tfmem.plan.build", "Partition": "tfmem.plan.build", "Transfer": "tfmem.plan.build",
    "validate": "tfmem.plan.build", "SwapPolicy": "tfmem.plan.swap", "Span": "tfmem.plan.swap",
    "StepStats": "tfmem.run.measuring.stats", "emulate_accelerator": "tfmem.memory.emulated",
    "reserve_emulated_memory": "tfmem.memory.emulated",
    "Placement": "tfmem.plan.place", "place": "tfmem.plan.place",
    "state_on_host": "tfmem.plan.place",
    "TFMemError": "tfmem.errors", "InvalidPlanError": "tfmem.errors",
    "UnsupportedGraphError": "tfmem.errors", "BudgetError": "tfmem.errors",
    "HostMemoryError": "tfmem.errors", "DeviceMemoryError": "tfmem.errors",
    "MemoryReport": "tfmem.run.measuring.memory_report", "StepRecord": "tfmem.run.front_end.step_record",
    "parse_bytes": "tfmem.memory.budget",
    "Session": "tfmem.run.front_end.session_factory", "session_config": "tfmem.run.front_end.session_factory",
    "CompileStats": "tfmem.run.compiling.compile_stats",
    "RemoteTaskError": "tfmem.run.front_end.remote",
    "function": "tfmem.tf2.function", "PartitionedFunction": "tfmem.tf2.function",
    "SessionCreator": "tfmem.run.front_end.monitored", "MonitoredSession": "tfmem.run.front_end.monitored",
    "MonitoredTrainingSession": "tfmem.run.front_end.monitored",
    "SingularMonitoredSession": "tfmem.run.front_end.monitored",
}
# Submodules exported by name (imported on first use): tfmem.keras.
_MODULES = {"keras": "tfmem.keras"}
# Modules that live in a wing but that users may reach from the package
# root (`tfmem.models.mlp`, `tfmem.proof.train`,
# `tfmem.serialize.plan_to_dict`): `tfmem.models` and `from tfmem import
# models` still work.  Every other module is reached by its wing's path.
_MOVED_MODULES = {"models": "tfmem.cli.models", "proof": "tfmem.cli.proof",
                  "serialize": "tfmem.cli.serialize"}

__all__ = sorted(list(_EXPORTS) + list(_MODULES))


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    if name in _MOVED_MODULES:
        return importlib.import_module(_MOVED_MODULES[name])
    raise AttributeError(f"module 'tfmem' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
