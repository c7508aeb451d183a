"""Own buffers: the variables a step updates made to own their buffers before it is planned.

A variable created while a function is traced (a Keras optimizer's slots, built on
its first `apply`) can share one buffer with others set to the same value: Keras
ResNet-50's Adam slots, 180 MiB of them, held 42 MiB after the trace.  The first
update of each finds its buffer shared and copies it (copy-on-write), so the first
step grows the device by the difference, and budget mode, which plans with what the
device holds beforehand, runs out of memory in it (ResNet-50 under a 342 MiB cap:
137 MiB in use before the first step, 261 MiB when it failed).

So before budget mode first plans a trace, each variable the trace updates is
assigned a copy of its own value: a shared buffer is copied now, and the device
holds what the step will hold.  The values are the same bits; a variable that owned
its buffer only swaps it for its copy.  The session front end counts the same
copies instead (tfmem.memory.first_updates): in a graph it cannot assign without
running the user's ops.
"""

import tensorflow as tf

from tfmem.plan.optypes import updates_variable


def updated_variables(concrete, view):
    """The variables of `concrete` (a ConcreteFunction) that the view's ops update."""
    handles = {node.inputs[0] for node in view.nodes.values() if updates_variable(node)}
    captured = {id(external) for external, internal in concrete.graph.captures
                if internal.name in handles}
    return [v for v in concrete.variables if id(v.handle) in captured]


def own_buffers(variables):
    """Assign each of `variables` a copy of its value (see the module docstring).  A
    variable whose device has no copy kernel for its dtype is left as it is: the plan
    may then miss its first update's copy, which budget mode learns from."""
    for variable in variables:
        with tf.device(variable.device):
            try:
                copy = tf.raw_ops.DeepCopy(x=variable.read_value())
            except tf.errors.NotFoundError:  # no DeepCopy kernel there for this dtype
                continue
            variable.assign(copy, read_value=False)
