"""The TensorFlow 2 back end: how a partition of a traced `tf.function` runs eagerly.

The Session front end (`tfmem.run.front_end.session`) copies partitions into a session's
graph and runs them as Session callables, with tensors crossing as session
handles.  This package is the same idea for eager TensorFlow 2, and nothing
more: analysis, partitioning, planning, the swap schedule, the host buffer
pool, the simulator and budget mode are shared, unchanged.

    compile.py   one partition -> its own ConcreteFunction (NodeDefs imported)
    transfers.py how tensors cross: EagerTensors kept, uploads on a thread
    execute.py   the eager front end of the shared step loop (tfmem.run.executing.step_loop):
                 how a partition is called and where its outputs go
    function.py  the front end: tfmem.function (tracing delegated to tf.function)

The public names are `tfmem.function` (function.py here; a module
`tfmem/function.py` would shadow the decorator `tfmem.function` once
imported) and `tfmem.keras`.
"""
