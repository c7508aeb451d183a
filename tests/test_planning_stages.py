"""The planning stages on their own: `units` and `partition` on hand-built views.

No TensorFlow graph is built: each test writes the GraphView it needs (op
names, types, edges, output dtypes) and checks the stage's invariants
directly, so a failure names the stage, not the whole pipeline.
"""

import types

import tensorflow as tf
from hypothesis import given, settings, strategies as st

from tfmem.plan.analyse import GraphView, OpNode, TensorInfo, split_tensor_name
from tfmem.plan.partition import depth_first_order, partition
from tfmem.plan.units import units

FLOAT = TensorInfo(tf.float32, (4,))
RESOURCE = TensorInfo(tf.resource, ())


def op(name, kind="Tanh", inputs=(), control=(), outputs=(FLOAT,), frame=None):
    return OpNode(name=name, type=kind, inputs=tuple(inputs), control_inputs=tuple(control),
                  outputs=tuple(outputs), stateful=False, side_effects=False, frame=frame)


def view(*ops, fetches=None, targets=(), feeds=()):
    """A GraphView of `ops` (in this discovery order); fetches default to the last op's output."""
    nodes = {node.name: node for node in ops}
    return GraphView(nodes=types.MappingProxyType(nodes), originals=frozenset(),
                     sources=types.MappingProxyType({}), feeds=frozenset(feeds),
                     fetches=tuple(fetches if fetches is not None else (f"{ops[-1].name}:0",)),
                     targets=tuple(targets))


def unit_of(groups, name):
    return next(group for group in groups if name in group)


def producers(v, name):
    node = v.nodes[name]
    return [split_tensor_name(t)[0] for t in node.inputs if split_tensor_name(t)[0] in v.nodes] \
        + [c for c in node.control_inputs if c in v.nodes]


def check_units(v, groups):
    """Every op in exactly one unit, each unit in view order, the unit graph acyclic."""
    order = list(v.nodes)
    assert sorted(name for group in groups for name in group) == sorted(order)
    for group in groups:
        assert list(group) == sorted(group, key=order.index)
    index = {name: i for i, group in enumerate(groups) for name in group}
    edges = {(index[p], index[n]) for n in v.nodes for p in producers(v, n) if index[p] != index[n]}
    remaining = set(range(len(groups)))
    while remaining:  # Kahn: an acyclic graph empties
        free = {u for u in remaining if not any(a in remaining and b == u for a, b in edges)}
        assert free, f"units on a cycle: {sorted(remaining)}"
        remaining -= free


def check_partitions(v, groups, parts, size):
    """Units whole and each once, producers no later than consumers, sizes kept."""
    assert sorted(unit for part in parts for unit in part) == sorted(groups)
    where = {name: i for i, part in enumerate(parts) for unit in part for name in unit}
    for name in v.nodes:
        for producer in producers(v, name):
            assert where[producer] <= where[name], (producer, name)
    for part in parts:
        ops = sum(len(unit) for unit in part)
        assert ops <= size or len(part) == 1, part


# -- units --------------------------------------------------------------------

def test_a_plain_dag_is_one_unit_per_op():
    v = view(op("a"), op("b", inputs=["a:0"]), op("c", inputs=["a:0", "b:0"]))
    groups = units(v)
    assert groups == (("a",), ("b",), ("c",))
    check_units(v, groups)


def test_a_run_bound_edge_keeps_producer_and_consumer_together():
    v = view(op("array", "TensorArrayV3", outputs=(RESOURCE, FLOAT)),
             op("write", "TensorArrayWriteV3", inputs=["array:0", "array:1"]),
             op("other", inputs=["array:1"]))
    groups = units(v)
    assert unit_of(groups, "array") == ("array", "write")
    assert ("other",) in groups
    check_units(v, groups)


def test_a_v1_loop_frame_is_one_unit_and_ends_at_its_exit():
    v = view(op("x"), op("enter", "Enter", inputs=["x:0"], frame="loop"),
             op("body", inputs=["enter:0"]), op("exit", "Exit", inputs=["body:0"]),
             op("after", inputs=["exit:0"]))
    groups = units(v)
    assert unit_of(groups, "enter") == ("enter", "body", "exit")
    assert ("x",) in groups and ("after",) in groups
    check_units(v, groups)


def test_a_v1_cond_joins_its_switch_branches_and_merge():
    v = view(op("x"), op("pred", outputs=(TensorInfo(tf.bool, ()),)),
             op("switch", "Switch", inputs=["x:0", "pred:0"], outputs=(FLOAT, FLOAT)),
             op("no", "Mul", inputs=["switch:0"]), op("yes", inputs=["switch:1"]),
             op("merge", "Merge", inputs=["no:0", "yes:0"]), op("after", inputs=["merge:0"]))
    groups = units(v)
    assert unit_of(groups, "switch") == ("switch", "no", "yes", "merge")
    assert ("after",) in groups and ("x",) in groups and ("pred",) in groups
    check_units(v, groups)


def test_sums_grappler_regroups_stay_whole_with_their_leaves():
    """Rule 4: a tree of sums (one AddN after Grappler, its inputs sorted by name) is one
    unit with its leaves' producers; two leaves, or an inner sum read twice, join nothing."""
    leaves = [op(n) for n in "xyzw"]
    v = view(*leaves, op("a", "AddV2", ["x:0", "y:0"]), op("b", "AddV2", ["a:0", "z:0"]),
             op("out", "Tanh", ["b:0"]))
    groups = units(v)
    check_units(v, groups)
    assert set(unit_of(groups, "b")) == {"a", "b", "x", "y", "z"}
    assert unit_of(groups, "w") == ("w",) and unit_of(groups, "out") == ("out",)

    v = view(*leaves, op("n", "AddN", ["x:0", "y:0", "z:0"]), op("two", "AddV2", ["w:0", "n:0"]))
    groups = units(v)
    check_units(v, groups)
    assert set(unit_of(groups, "n")) == {"n", "x", "y", "z", "two", "w"}  # one tree, 4 leaves

    v = view(*leaves, op("a", "AddV2", ["x:0", "y:0"]), op("b", "AddV2", ["a:0", "z:0"]),
             op("c", "Tanh", ["a:0"]), op("out", "Tanh", ["b:0", "c:0"]))
    groups = units(v)
    check_units(v, groups)
    assert unit_of(groups, "a") == ("a",)  # read twice: Grappler keeps it, b adds two leaves
    assert unit_of(groups, "x") == ("x",)


def test_a_sum_of_products_stays_with_them():
    """Rule 4: Grappler hoists a common factor out of a sum of products (x*k + y*k)."""
    v = view(op("x"), op("y"), op("k"), op("p", "Mul", ["x:0", "k:0"]),
             op("q", "Mul", ["y:0", "k:0"]), op("s", "AddV2", ["p:0", "q:0"]))
    groups = units(v)
    check_units(v, groups)
    assert set(unit_of(groups, "s")) == {"p", "q", "s"}
    assert unit_of(groups, "x") == ("x",)


def test_units_on_a_cycle_merge():
    # make -> use is run-bound (one unit), but `use` also reads `middle`, which reads `make`:
    # {make, use} <-> {middle} would depend on each other.
    v = view(op("make", "StackV2", outputs=(RESOURCE, FLOAT)), op("middle", inputs=["make:1"]),
             op("use", "StackPushV2", inputs=["make:0", "middle:0"]))
    groups = units(v)
    assert groups == (("make", "middle", "use"),)
    check_units(v, groups)


# -- partition ----------------------------------------------------------------

def chain(length, prefix="c", first_input=None):
    ops = []
    for i in range(length):
        source = f"{prefix}{i - 1}:0" if i else first_input
        ops.append(op(f"{prefix}{i}", inputs=[source] if source else []))
    return ops


def test_a_chain_is_cut_in_order_into_partitions_of_at_most_the_size():
    v = view(*chain(7))
    groups = units(v)
    parts = partition(v, groups, 3)
    assert [[n for unit in part for n in unit] for part in parts] == \
        [["c0", "c1", "c2"], ["c3", "c4", "c5"], ["c6"]]
    check_partitions(v, groups, parts, 3)


def test_the_shallowest_input_is_walked_first():
    deep, shallow = chain(4, "d"), chain(1, "s")
    v = view(*deep, *shallow, op("loss", inputs=["d3:0", "s0:0"]))
    groups = units(v)
    order = [groups[i][0] for i in depth_first_order(v, groups)]
    assert order == ["s0", "d0", "d1", "d2", "d3", "loss"]


def test_a_shape_read_follows_its_operand_at_once():
    v = view(op("big"), op("shape", "Shape", inputs=["big:0"]),
             *chain(3, "w", first_input="big:0"), op("loss", inputs=["w2:0", "shape:0"]))
    groups = units(v)
    order = [groups[i][0] for i in depth_first_order(v, groups)]
    assert order.index("shape") == order.index("big") + 1


def test_a_unit_larger_than_the_size_gets_a_partition_of_its_own_and_is_never_cut():
    v = view(op("x"), op("enter", "Enter", inputs=["x:0"], frame="f"),
             *chain(4, "b", first_input="enter:0"), op("exit", "Exit", inputs=["b3:0"]),
             op("after", inputs=["exit:0"]))
    groups = units(v)
    parts = partition(v, groups, 2)
    loop = unit_of(groups, "enter")
    assert len(loop) == 6 and (loop,) in parts
    check_partitions(v, groups, parts, 2)


@st.composite
def dags(draw):
    """Random DAGs of up to 25 ops; some edges run-bound, so units of several ops occur."""
    count = draw(st.integers(1, 25))
    ops = []
    for i in range(count):
        sources = draw(st.lists(st.integers(0, i - 1), max_size=3, unique=True)) if i else []
        bound = draw(st.booleans()) and i % 3 == 0
        outputs = (RESOURCE, FLOAT) if bound else (FLOAT,)
        inputs = [f"op{s}:{0 if ops[s].outputs == (FLOAT,) else draw(st.integers(0, 1))}"
                  for s in sources]
        ops.append(op(f"op{i}", inputs=inputs, outputs=outputs))
    return view(*ops, fetches=[f"op{count - 1}:0"]), draw(st.integers(1, 8))


@settings(max_examples=60, deadline=None)
@given(dags())
def test_units_and_partitions_keep_their_invariants_on_random_dags(case):
    v, size = case
    groups = units(v)
    check_units(v, groups)
    check_partitions(v, groups, partition(v, groups, size), size)
