"""Cubes: a partition computes `x ** 3` with the product the whole function uses.

On the CPU, Grappler's arithmetic optimizer turns `pow(x, 3)` into
`x * square(x)`.  It names the square `<scope>/ArithmeticOptimizer/
ConvertPow__inner_<name>`, unless the function already has an equal square:
the `pow(x, 2)` of the power's gradient is one, and Grappler keeps the one
that comes first.  Constant folding then multiplies the cube's constant
factor (the `0.044715 * x ** 3` of approximate GELU) into whichever of `x`
and the square has the smaller name, so the last bits depend on names.

A partition is optimised on its own, often without the gradient's square,
and its names are encoded (sorted_names), before which Grappler's
`ArithmeticOptimizer/...` sorts.  So a partition running on the CPU gets each
cube already written as `x * square(x)`, the square named (encoded) after
the square the whole function keeps and placed first, so that Grappler keeps
it among equal squares in the partition too.  The cube and its product stay
in one partition (plan/units.py, rule 5).
"""

import numpy as np
import tensorflow as tf

from tfmem import tf_private

_FOLDED = {"Sub": np.subtract, "AddV2": np.add, "Add": np.add, "Mul": np.multiply}


def functions_run_on_cpu():
    """Whether tf.function's ops run on the CPU here (no GPU or TPU): where Grappler
    writes cubes out."""
    return not any(d.device_type in ("GPU", "TPU") for d in tf.config.list_logical_devices())


def _folded_value(tensor, depth=4):
    """The value Grappler's constant folding gives `tensor`, for constants and a little
    arithmetic on them (a gradient's exponent `y - 1`); None otherwise."""
    op = tensor.op
    if op.type == "Const":
        return tf.make_ndarray(op.get_attr("value"))
    if op.type in _FOLDED and depth > 0:
        values = [_folded_value(t, depth - 1) for t in op.inputs]
        if all(v is not None for v in values):
            return _FOLDED[op.type](*values)
    return None


def _is_square(op):
    """Whether `op` is `square(x)` in the whole function: a Square, or a power whose
    exponent folds to 2 (Grappler makes it a Square)."""
    if op.type == "Square":
        return True
    value = _folded_value(op.inputs[1]) if op.type == "Pow" else None
    return value is not None and value.size > 0 and bool((value == 2).all())


def _square_name(cube, view):
    """The name of the square the whole graph multiplies `x` by in `cube = x ** 3`: the
    first square of `x` among the request's ops (`square(x)`, `pow(x, 2)`), else
    Grappler's own."""
    x = cube.inputs[0]
    squares = [r for r in x.consumers()
               if r.name in view.nodes and r.inputs[0] is x and _is_square(r)]
    if squares:
        return min(squares, key=tf_private.creation_index).name
    scope, _, base = cube.name.rpartition("/")
    return f"{scope}/ArithmeticOptimizer/ConvertPow__inner_{base}".lstrip("/")


def write_out(graph_def, graph, view, ops, node_name):
    """Write each cube among `ops` (ops of the request `view`) in `graph_def`, a
    partition's NodeDefs named `node_name(op name)`, as `x * square(x)` (see the module
    docstring)."""
    nodes = {node.name: node for node in graph_def.node}
    squares = []
    for name in ops:
        node = nodes.get(node_name(name))
        if node is None or node.op != "Pow" or view.nodes[name].arithmetic_type != "Mul":
            continue
        square_name = node_name(_square_name(graph.get_operation_by_name(name), view))
        x_input = node.input[0]
        if square_name not in nodes:  # the whole graph's square is not in this partition
            square = tf.compat.v1.NodeDef(name=square_name, op="Square", input=[x_input],
                                          device=node.device)
            square.attr["T"].CopyFrom(node.attr["T"])
            nodes[square_name] = square
            squares.append(square)
        controls = [inp for inp in node.input if inp.startswith("^")]
        node.op = "Mul"
        del node.input[:]
        node.input.extend([x_input, square_name] + controls)
    if squares:
        rest = list(graph_def.node)
        del graph_def.node[:]
        graph_def.node.extend(squares + rest)
