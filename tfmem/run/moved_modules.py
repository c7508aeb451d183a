"""Flat module names of the run wing (`tfmem.run.session`, ...) resolve to the modules
in their concern's folder (`tfmem.run.front_end.session`), with a DeprecationWarning
naming the new path, so that programs importing them keep working."""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

FOLDER_OF = {
    **dict.fromkeys(("session", "session_factory", "session_interface", "monitored",
                     "interrupts", "request", "plan_cache", "run_metadata", "remote",
                     "budget_learning", "options", "request_planner", "step_record"),
                    "front_end"),
    **dict.fromkeys(("plan_import", "prun_import", "rewrite", "graph_copy", "graph_growth",
                     "colocation", "regrouping", "compile_stats", "request_compiler"),
                    "compiling"),
    **dict.fromkeys(("execute", "step_loop", "swap_manager", "buffers", "prefetch",
                     "residence", "partial_run", "c_path", "host_memory"), "executing"),
    **dict.fromkeys(("stats", "sampling", "trace", "call_peaks", "remeasure", "report_text",
                     "memory_report"), "measuring"),
    **dict.fromkeys(("placement_pass", "accelerator"), "placement"),
}


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module at its new path."""

    def __init__(self, target):
        self.target = target

    def create_module(self, spec):
        warnings.warn(f"{spec.name} is deprecated: import {self.target}", DeprecationWarning,
                      stacklevel=2)
        return importlib.import_module(self.target)

    def exec_module(self, module):
        pass  # the module at the new path is imported already


class _MovedModules(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != "tfmem.run" or name not in FOLDER_OF:
            return None
        return importlib.util.spec_from_loader(fullname,
                                               _Alias(f"tfmem.run.{FOLDER_OF[name]}.{name}"))


def install():
    """Adds the finder once, after every other: a name that exists is never its business."""
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModules())
