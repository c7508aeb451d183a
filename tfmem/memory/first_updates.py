"""First updates: the device memory a resource variable's first in-place update adds.

A resource variable assigned from a constant shares the constant's buffer: the
Const kernel, cached with the initializing run's executor, keeps that tensor, and
AssignVariableOp, unable to take it over, adopts it without copying.  The
variable's first in-place update (ResourceApplyMomentum, AssignAddVariableOp, ...)
finds its buffer shared and copies it first; the constant keeps the old buffer for as
long as the executor lives:

    initializing run    zeros (Const, kept) == var         one buffer
    first update        zeros (Const, kept)    var'        two, for good

Measured on TensorFlow 2.21 under the BFC allocator (tests/test_first_updates.py):
the first update of a zeros- or ones-initialised resource variable adds its size,
once; a randomly initialised one and a ref variable (whose Assign copies when it
initializes) add nothing.  Momentum's and Adam's slots are zeros-initialised, so a
training step's first run grows the device by their size: 3.0 MiB for the 12-layer
MLP, 6.9 MiB for the MoE experiment at 51 experts, near the end of the step, where
its updates run.  TensorFlow merges equal initial constants (the zeros of momentum
slots of one shape), so the variables set from them share one buffer among
themselves too.

A plain `sess.run(init)` keeps its executor, and so the constants, until the session
closes.  TFMemSession releases the executor of an initializing request (`assigned`)
after its first step instead: the constants free, and a variable set to a value no
other shares owns its buffer, so its first update copies nothing (MoE at 44 experts
keeps 11.8 MiB after a step instead of 17.8; ResNet-56 14.7 instead of 22.0).
Variables set to one merged value share its buffer, and each update of one but the
last copies it; the state counts every one of them at its size, so those copies never
take the device past the state either: nothing is pending for any variable the
released executor set (counting the merged ones as pending would add 25.6 MiB at
ResNet-186 and set that experiment's floor).  Ref variables' constants free as well.

Budget mode counts the pending copies as held beside the request for the whole of
its first step (`pending_bytes`), so the plan it runs first still fits once they are
copied; from then on the allocator's own figure holds them (tfmem.memory.resident).
"""

from tfmem.plan.analyse import split_tensor_name
from tfmem.plan.updates import is_update

_RESOURCE_VARIABLES = frozenset({"VarHandleOp"})
_ASSIGNS = frozenset({"AssignVariableOp", "Assign"})  # set a variable to a value


def written_variables(view):
    """Names of the resource variables (VarHandleOp sources) the request's update ops
    write."""
    written = set()
    for node in view.nodes.values():
        if not is_update(node.type):
            continue
        for tensor in node.inputs:
            name = split_tensor_name(tensor)[0]
            source = view.sources.get(name)
            if source is not None and source.type in _RESOURCE_VARIABLES:
                written.add(name)
    return frozenset(written)


def _constant(op, memo):
    """True when `op`'s value is computed from constants alone (Grappler folds it into
    a Const, whose kernel keeps the tensor); `memo` holds the answers found so far."""
    stack, visiting = [op], set()
    while stack:
        current = stack[-1]
        if current.name in memo:
            stack.pop()
        elif current.type == "Const":
            memo[current.name] = True
        elif (not current.inputs or current.op_def.is_stateful
              or current.type.startswith("Placeholder")):
            memo[current.name] = False
        elif current.name not in visiting:  # its inputs first (an input in a cycle: not constant)
            visiting.add(current.name)
            stack.extend(t.op for t in current.inputs
                         if t.op.name not in memo and t.op.name not in visiting)
        else:
            memo[current.name] = all(memo.get(t.op.name, False) for t in current.inputs)
    return memo[op.name]


def constant_initialised(graph, names):
    """Those of the variables `names` that some AssignVariableOp of `graph` sets to a value
    computed from constants alone: their buffer may be shared with a kept constant."""
    memo, shared = {}, set()
    for name in names:
        handle = graph.get_operation_by_name(name).outputs[0]
        for consumer in handle.consumers():
            if consumer.type == "AssignVariableOp" and _constant(consumer.inputs[1].op, memo):
                shared.add(name)
                break
    return frozenset(shared)


def assigned(graph, view):
    """Names of the variables the request's assign ops set to a value computed from
    constants alone: those of an initializing request, whose executor keeps the
    constants."""
    memo, names = {}, set()
    for name, node in view.nodes.items():
        if node.type not in _ASSIGNS:
            continue
        variable = split_tensor_name(node.inputs[0])[0]
        if variable in view.sources and _constant(
                graph.get_operation_by_name(name).inputs[1].op, memo):
            names.add(variable)
    return frozenset(names)


def pending_bytes(graph, view, owned=frozenset()):
    """Bytes the request's next step may add to the device by copying the buffers of
    constant-initialised resource variables it updates in place (`owned`: variables
    known to share no buffer with a kept constant: an earlier step has written them,
    or tfmem released the executor that set them)."""
    fresh = written_variables(view) - owned
    return sum(view.sources[name].state_bytes for name in constant_initialised(graph, fresh))
