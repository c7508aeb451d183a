"""The run wing: a plan copied into the session's graph and executed step by step.

    front_end/   TFMemSession and what makes it a session (requests, plan cache, metadata)
    compiling/   a plan's partitions copied into the session's graph
    executing/   a step's calls, swaps, uploads and host buffers
    measuring/   which steps are measured, their statistics, reports and traces
    placement/   the device a session runs on, and the user's state put on the host

It uses the plan and memory wings and never the command line.  The flat module
names (`tfmem.run.front_end.session`, ...) still import, with a DeprecationWarning
(`moved_modules`).
"""

from tfmem.run import moved_modules

moved_modules.install()
