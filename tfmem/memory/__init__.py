"""The memory wing: what a plan's step will need, predicted without running it.

    shapes.py     every tensor of a request with its unknown dimensions resolved
    simulate.py   replay a plan's device and host memory
    scratch.py    the scratch memory of each kernel, measured once in a scratch session
    workspace.py  outputs kernels return past the op's own (oneDNN max pooling's), measured
    dedup.py      the equal ops TensorFlow merges before a partition runs
    sizing.py     a request's shapes, kernel scratch, workspaces and op signatures, read once
    budget.py     the plan with the fewest partitions that fits a device budget
    learning.py   budget mode's correction after a step that measured over its prediction
    oom.py        out-of-memory advice: what held the memory, what would fit
    emulated.py   the emulated accelerator's cap (environment only)
    sizes.py      bytes written as MiB

It predicts from plans (imports the plan wing) and never imports the runtime.
"""
