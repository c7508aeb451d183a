"""Colocation: the groups of ops TensorFlow's placer puts on one device.

The placer keeps together, whatever devices they request:

* ops linked by a `_class` attribute (`loc:@w`, written by `colocate_with`,
  by optimizers for slot variables and updates, by variable initializers);
* the two ends of an edge into a reference or resource input: a variable and
  every op that reads, assigns or updates it (`Assign`, `ReadVariableOp`,
  `ApplyAdam`...).  An op reading a reference as a value (`SaveV2`) is free,
  and so are ops that forward resources into functions they place themselves
  (function calls, some datasets: TensorFlow's "input colocation exemption").

    w (VarHandleOp) --resource--> ReadVariableOp -> MatMul
        ^  \\--resource--> ResourceApplyAdam <-- m (`_class` loc:@w)
        `_class`
    w/Initializer

gives the group {w, ReadVariableOp, ResourceApplyAdam, m, w/Initializer};
MatMul reads a plain tensor and is free to run elsewhere.  Moving a variable
means moving its whole group, or TensorFlow refuses the placement.
"""

import tensorflow as tf

from tfmem import tf_private


class _UnionFind:
    def __init__(self):
        self._parent = {}

    def find(self, name):
        parent = self._parent.setdefault(name, name)
        while parent != name:
            grand = self._parent.setdefault(parent, parent)
            self._parent[name] = grand
            name, parent = parent, grand
        return name

    def union(self, a, b):
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self._parent[ra] = rb

    def names(self):
        return list(self._parent)


_EXEMPT_CACHE = {}


def _exempt(op):
    """True for ops that pass resources into functions they place themselves
    (function calls, datasets with a function): TensorFlow does not colocate them."""
    exempt = _EXEMPT_CACHE.get(op.type)
    if exempt is None:
        exempt = _EXEMPT_CACHE[op.type] = any(
            attr.type in ("func", "list(func)") for attr in op.op_def.attr)
    return exempt


def _colocates(input_type):
    """True for an input TensorFlow puts on its producer's device: a reference or a
    resource *input* (a reference read by a value input, like SaveV2's, is not)."""
    return input_type != input_type.base_dtype or input_type.base_dtype == tf.resource


def colocation_groups(graph):
    """{op name: frozenset of the op names placed with it}, for every op of `graph`
    that shares its device with another op (an op alone is not listed)."""
    groups, ops = _UnionFind(), graph.get_operations()
    names = {op.name for op in ops}
    for op in ops:
        for group in op.colocation_groups():
            target = group.decode()[len("loc:@"):]
            if target != op.name and target in names:
                groups.union(op.name, target)
        input_types = tf_private.declared_input_types(op)
        for tensor, input_type in zip(op.inputs, input_types):
            if _colocates(input_type) and not _exempt(op):
                groups.union(op.name, tensor.op.name)
    members = {}
    for name in groups.names():
        members.setdefault(groups.find(name), set()).add(name)
    return {name: frozenset(group) for group in members.values() for name in group}
