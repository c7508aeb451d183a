"""An IdentityN that Grappler removes does not hold its readers back.

Keras's optimizers pass a step's gradients through one IdentityN.  Grappler's
dependency optimizer removes it from every partition function that reads its
outputs itself, so each variable's update arithmetic runs as soon as its own
gradient is there, beside the long kernels of the last gradients: its results
(held to the partition's end) are alive at their peak.  An emulated executor
that waits for the IdentityN puts them all after that peak.

Measured as tests/test_long_kernels.py measures (conftest.one_partition_peak, one
fresh process per kernel path), with the small ops behind an IdentityN.
"""

import pytest
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2

from conftest import one_partition_peak
from tfmem.run.compiling import regrouping

MIB = 1 << 20

BODY = """
def body(m, v):
    # the long branch first: four 1024 x 1024 products, then a 32 MiB tile
    h = m
    for _ in range(4):
        h = tf.matmul(h, m)
    total = tf.reduce_sum(tf.tile(h, [8, 1]))
    # the long branch's result and forty inputs joined as Keras joins a step's gradients
    joined = tf.identity_n([total] + [v] * 40)
    # forty small results of 0.5 MiB each, returned: held to the end
    return total, [tf.sin(g + float(i)) for i, g in enumerate(joined[1:])]
"""


@pytest.mark.parametrize("onednn", [False, True])
def test_readers_of_a_removed_identity_n_run_beside_a_long_kernel(onednn):
    figures = one_partition_peak(BODY, onednn)
    assert figures["partitions"] == 1
    assert len(figures["dissolved"]) == 1
    # Grappler removed the IdentityN: the forty small results (20 MiB) were alive
    # beside the tile (32 MiB) and a product (4 MiB)
    assert figures["measured"] > 52 * MIB
    assert figures["measured"] <= figures["chunks"]


def _config(**rewrite):
    return config_pb2.ConfigProto(graph_options=config_pb2.GraphOptions(
        rewrite_options=rewriter_config_pb2.RewriterConfig(**rewrite)))


def test_identities_are_removed_where_the_dependency_optimizer_runs():
    off = rewriter_config_pb2.RewriterConfig.OFF
    assert regrouping.runs_dependency_optimizer(None)
    assert regrouping.runs_dependency_optimizer(_config())
    assert regrouping.runs_dependency_optimizer(_config(arithmetic_optimization=off))
    assert not regrouping.runs_dependency_optimizer(_config(dependency_optimization=off))
    assert not regrouping.runs_dependency_optimizer(_config(disable_meta_optimizer=True))


def _joined_graph():
    """A long chain and a small input joined by an IdentityN (inside one of its own),
    whose small output is squared, and a second IdentityN whose output is fetched."""
    import tensorflow.compat.v1 as tf1  # pylint: disable=import-outside-toplevel
    graph = tf1.Graph()
    with graph.as_default():
        big = tf1.placeholder(tf1.float32, [64, 64], name="big")
        small = tf1.placeholder(tf1.float32, [8], name="small")
        h = big
        for _ in range(3):
            h = tf1.matmul(h, big)
        last = tf1.reduce_sum(h, name="last")
        inner = tf1.identity_n([last, small], name="inner")
        outer = tf1.identity_n([inner[0], inner[1]], name="outer")
        squared = tf1.square(outer[1], name="squared")
        total = tf1.add(outer[0], tf1.reduce_sum(squared), name="total")
        fetched = tf1.identity_n([last, small], name="fetched")
    return graph, [total, fetched[1]], [big, small]


def test_a_removed_identity_n_makes_each_reader_wait_for_its_own_input():
    from tfmem.memory import op_order  # pylint: disable=import-outside-toplevel
    from tfmem.plan.analyse import analyse  # pylint: disable=import-outside-toplevel
    graph, fetches, feeds = _joined_graph()
    with graph.as_default():
        view = analyse(fetches, [], feeds)
        kept = analyse(fetches, [], feeds, removes_identities=False)
    ops = tuple(view.nodes)
    # "fetched" is a fetch: Grappler keeps it; the other two go, the inner one too
    assert op_order.dissolved_identities(view, ops) == {"inner", "outer"}
    assert op_order.dissolved_identities(kept, ops) == frozenset()
    # a partition that returns one of its outputs keeps it
    assert "outer" not in op_order.dissolved_identities(
        view, tuple(op for op in ops if op != "squared"))

    def square_before_last(v):  # in some emulated order: beside a long kernel
        return any(order.index("squared") < order.index("last")
                   for order in op_order.executor_orders(v, ops, threads=2))
    assert square_before_last(view)  # the small input's square waits for nothing
    assert not square_before_last(kept)  # behind the IdentityN, it waits for the chain
