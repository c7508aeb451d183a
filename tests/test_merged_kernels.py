"""Kernels oneDNN merges stay together: in one partition, and one right after the other
where tfmem chains a partition's copies, with only the ops on paths between them
(Grappler's forwards, `tf.tuple`'s gate) in between.

With oneDNN on, TensorFlow merges a Conv2DBackpropFilter and the BiasAddGrad reading
the same gradient into one kernel; a chain edge through any other op between them
made the merged kernel a cycle that TensorFlow's executor silently never ran
(tests/test_kernel_paths.py runs a real program on both kernel paths).  Here the
plans themselves are checked, on that program's training step, whose gradient
summaries read the bias gradients (readers the order may put between the two).
"""


import pytest
import tensorflow as tf

from tfmem.memory import op_order
from tfmem.plan.analyse import analyse, split_tensor_name
from tfmem.plan.build import make_plan
from tfmem.plan.merged_kernels import merged_groups

from programs import cifar10_tf1 as cifar

tf1 = tf.compat.v1


def _cifar_step():
    """The training step of tests/programs/cifar10_tf1.py: (graph, fed images and labels,
    train op, merged summaries)."""
    graph = tf.Graph()
    with graph.as_default():
        step = tf1.train.get_or_create_global_step()
        x = tf1.placeholder(tf.float32, [cifar.BATCH, cifar.SIZE, cifar.SIZE, 3])
        y = tf1.placeholder(tf.int32, [cifar.BATCH])
        train = cifar.train(cifar.total_loss(cifar.inference(x), y), step)
        summaries = tf1.summary.merge_all()
    return graph, [x, y], train, summaries


def _paths_between(view, group):
    """The group's ops and every op on a path from one of them to another."""
    readers, producers = {}, {}
    for name, node in view.nodes.items():
        for src in [split_tensor_name(t)[0] for t in node.inputs] + list(node.control_inputs):
            if src in view.nodes:
                readers.setdefault(src, set()).add(name)
                producers.setdefault(name, set()).add(src)

    def reach(edges):
        seen, stack = set(), list(group)
        while stack:
            for nxt in edges.get(stack.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return seen
    return set(group) | (reach(readers) & reach(producers))


@pytest.mark.parametrize("partition_size", [3, 7, 20, 50])
def test_merged_kernels_run_together_in_the_chained_order(partition_size):
    graph, fed, train, summaries = _cifar_step()
    with graph.as_default():
        view = analyse([summaries], [train], fed, chained=True)
    groups = merged_groups(view)
    assert len(groups) == 2  # one per biased convolution
    assert all({view.nodes[n].type for n in g} == {"Conv2DBackpropFilter", "BiasAddGrad"}
               for g in groups)
    plan = make_plan(view, partition_size)
    for group in groups:
        homes = [p for p in plan.partitions if set(group) & set(p.ops)]
        assert len(homes) == 1 and set(group) <= set(homes[0].ops), group
        order = op_order.chained_order(view, homes[0].ops)
        assert order is not None
        position = {name: i for i, name in enumerate(order)}
        for name in order:  # producers first
            node = view.nodes[name]
            for src in [split_tensor_name(t)[0] for t in node.inputs] + list(node.control_inputs):
                assert position.get(src, -1) < position[name], (src, name)
        first, last = min(position[n] for n in group), max(position[n] for n in group)
        between = set(order[first:last + 1])
        assert between <= _paths_between(view, group), sorted(between - _paths_between(view, group))
