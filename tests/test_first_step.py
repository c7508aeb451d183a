"""The first step's compile path: copies reused across feed shapes, tfmem's session factory.

Budget mode plans per feed shape; a plan already copied into the graph serves
every shape whose predicted peak fits, so the graph grows only when a shape
needs more partitions than any compiled plan has, and never once shapes repeat.
`tfmem.Session` / `tfmem.session_config` turn Grappler off: partitioned results
must then equal plain `Session.run` on the same config bit for bit (its own
session graph: test_graph_copy.py).
"""

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from tfmem.memory import budget
from tfmem.cli import models

tf1 = tf.compat.v1


def _threads(config=None):
    config = config or tf1.ConfigProto()
    config.intra_op_parallelism_threads = 1
    config.inter_op_parallelism_threads = 1
    return config


def _budget_splitting(model, batch):
    """A budget under which one partition of `batch` does not fit (about 0.6 of its peak)."""
    with tf1.Session(graph=model.graph) as sess:
        probe = tfmem.TFMemSession(sess, device_memory_budget="64GiB")
        peak = probe.simulate([model.train, model.loss], model.feed(batch)).peak_device
    return int(peak * 0.6 / (1 - budget.DEFAULT_MARGIN))


def test_budget_mode_reuses_copies_for_new_shapes_and_stops_growing():
    model = models.mlp(layers=6, width=128, features=128)
    fetches = [model.train, model.loss]
    budget_bytes = _budget_splitting(model, 256)
    plain = tf1.Session(graph=model.graph, config=_threads())
    wrapped = tf1.Session(graph=model.graph, config=_threads())
    tfs = tfmem.TFMemSession(wrapped, device_memory_budget=budget_bytes)
    plain.run(model.init)
    wrapped.run(model.init)
    sizes, compiles = [], []
    for batch in (256, 64, 200, 256, 64, 200, 32):
        feed = model.feed(batch, data_seed=batch)
        expected = plain.run(fetches, feed)[1]
        got = tfs.run(fetches, feed)[1]
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
        sizes.append(model.graph.version)
        compiles.append(tfs.last_compile)
    # The copies made for batch 256 serve the smaller batches: one copy in all.
    assert sizes == [sizes[0]] * len(sizes), sizes
    assert tfs.last_step.partitions > 1  # the budget splits the step
    assert not compiles[0].reused and compiles[0].graph_ops_after == sizes[0]
    assert compiles[1].reused and compiles[2].reused and compiles[-1].reused
    # The small batch alone would have been planned with fewer partitions.
    alone = tfmem.TFMemSession(plain, device_memory_budget=budget_bytes)
    assert len(alone.plan(fetches, model.feed(64)).partitions) < tfs.last_step.partitions
    plain.close()
    tfs.close()


@pytest.mark.slow
def test_budget_mode_graph_stops_growing_once_shapes_repeat():
    """Growing shapes need new plans; once the shapes come again the graph stays put."""
    model = models.mlp(layers=6, width=128, features=128)
    fetches = [model.train, model.loss]
    budget_bytes = _budget_splitting(model, 512)
    with tf1.Session(graph=model.graph, config=_threads()) as sess:
        tfs = tfmem.TFMemSession(sess, device_memory_budget=budget_bytes)
        sess.run(model.init)
        tfs.run(fetches, model.feed(32))
        first = model.graph.version
        rounds = []
        for _ in range(3):
            for batch in (32, 128, 512, 96):
                tfs.run(fetches, model.feed(batch))
            rounds.append(model.graph.version)
        assert rounds[0] > first  # batch 512 needed a plan of its own
        assert rounds[0] == rounds[1] == rounds[2], rounds


@pytest.mark.slow
def test_tfmem_session_matches_plain_runs_bit_for_bit():
    """Same config on both sides: Grappler off, so no subgraph is rewritten differently."""
    model = models.resnet(blocks=(1, 1, 1), width=4, image=8)
    fetches = [model.train, model.loss]
    feed = model.feed(4)
    tfs = tfmem.Session(graph=model.graph, config=_threads(), partition_size=20)
    plain = tf1.Session(graph=model.graph, config=tfmem.session_config(_threads()))
    assert tfs.session._config.graph_options.rewrite_options.disable_meta_optimizer  # pylint: disable=protected-access
    tfs.run(model.init)
    plain.run(model.init)
    got = [tfs.run(fetches, feed)[1] for _ in range(3)]
    expected = [plain.run(fetches, feed)[1] for _ in range(3)]
    assert tfs.last_step.partitions > 1
    np.testing.assert_array_equal(got, expected)
    tfs.close()
    plain.close()


def test_session_config_keeps_the_callers_settings_and_refuses_other_types():
    config = tfmem.session_config(_threads())
    assert config.intra_op_parallelism_threads == 1
    assert config.graph_options.rewrite_options.disable_meta_optimizer
    assert not tfmem.session_config().graph_options.place_pruned_graph
    with pytest.raises(TypeError, match="ConfigProto"):
        tfmem.session_config({"intra_op_parallelism_threads": 1})
    with pytest.raises(ValueError, match="partition_size"):
        tfmem.Session(graph=tf.Graph(), partition_size=0)
