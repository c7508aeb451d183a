"""Executing a step and swapping its tensors.

    step_loop.py          one step: a call per partition, shared with tfmem.function
    execute.py            the Session front end of that loop: one call per stretch
    partial_run.py        a step as one DirectSession partial run
    c_path.py             a stretch run by name through Session.run (executors shared by every step)
    swap_manager.py       the transfers of one step, on the device or in host buffers
    residence.py          where a kept tensor waits (session handles, worker staging)
    prefetch.py           uploads back to the device on a background thread
    buffers.py            the pool of host buffers
    host_memory.py        a plan refused when the host cannot hold its swapped tensors
"""
