"""The memory wing: what a plan's step will need, predicted without running it.

    shapes.py     every tensor of a request with its unknown dimensions resolved
    simulate.py   replay a plan's device and host memory
    scratch.py    the scratch memory of each kernel, measured once in a scratch session
    sizing.py     a request's shapes and kernel scratch at its fed shapes, read once
    budget.py     the plan with the fewest partitions that fits a device budget
    learning.py   budget mode's correction after a step that measured over its prediction
    oom.py        out-of-memory advice: what held the memory, what would fit
    emulated.py   the emulated accelerator's cap (environment only)
    sizes.py      bytes written as MiB

It predicts from plans (imports the plan wing) and never imports the runtime.
"""
