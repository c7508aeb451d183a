"""Kernel scratch calibration: what each kernel configuration allocates besides its
outputs, measured once in a scratch session, cached, and never touching the user's
graph, session or variables.  Runs in this process (no cap needed: TensorFlow's
step statistics track each op's own allocations with any allocator)."""

import json

import numpy as np
import tensorflow as tf

import tfmem
from tfmem.cli import models
from tfmem.memory import scratch
from tfmem.plan.analyse import analyse
from tfmem.run.executing.execute import measured_scratch

tf1 = tf.compat.v1
CONFIG = tf1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)


def _request(model, batch):
    feed = model.feed(batch)
    view = analyse([model.loss], [model.train], list(feed))
    return view, {t.name: v.shape for t, v in feed.items()}


def test_convolution_gradients_have_scratch_and_elementwise_ops_none(tmp_path):
    model = models.convnet()
    view, shapes = _request(model, 48)
    cache = scratch.ScratchCache(str(tmp_path / "kernels.json"))
    with tf1.Session(graph=model.graph, config=CONFIG) as sess:
        version = model.graph.version
        found = scratch.calibrate(model.graph, view, shapes, sess, cache=cache)
        assert model.graph.version == version, "calibration added ops to the user's graph"
        # Nothing ran in the user's session: its variables are still uninitialised.
        with model.graph.as_default():
            assert len(sess.run(tf1.report_uninitialized_variables())) > 0
    kinds = {view.nodes[name].type for name in found}
    # Which kernels take scratch depends on the kernel path of this process (oneDNN or
    # not): convolution or pooling gradients, in either.
    assert kinds & {"Conv2DBackpropFilter", "Conv2DBackpropInput", "Conv2D",
                    "MaxPoolGrad"}, found
    assert max(found.values()) > 64 << 10
    assert not kinds & {"Relu", "Mul", "AddV2", "Identity", "ApplyMomentum",
                        "ResourceApplyMomentum"}
    assert all(not view.nodes[name].stateful for name in found)


def test_calibrations_are_cached_and_saved(tmp_path):
    model = models.convnet()
    view, shapes = _request(model, 48)
    path = str(tmp_path / "kernels.json")
    first = scratch.ScratchCache(path)
    with tf1.Session(graph=model.graph, config=CONFIG) as sess:
        found = scratch.calibrate(model.graph, view, shapes, sess, cache=first)
        measured = first.measured
        assert measured > 0
        assert scratch.calibrate(model.graph, view, shapes, sess, cache=first) == found
        assert first.measured == measured, "a cached configuration was measured again"
        # A new process (a new cache on the same file) plans without measuring.
        second = scratch.ScratchCache(path)
        assert len(second) == len(first)
        assert scratch.calibrate(model.graph, view, shapes, sess, cache=second) == found
        assert second.measured == 0
        # Another batch is another configuration.
        other, other_shapes = _request(model, 16)
        scratch.calibrate(model.graph, other, other_shapes, sess, cache=second)
        assert second.measured > 0
    assert len(json.loads(open(path, encoding="utf-8").read())) == len(second)


def test_calibration_agrees_with_the_steps_own_statistics():
    """The user's real step, traced, reports per op what calibration measured alone."""
    model = models.convnet()
    view, shapes = _request(model, 48)
    with tf1.Session(graph=model.graph, config=CONFIG) as sess:
        found = scratch.calibrate(model.graph, view, shapes, sess,
                                  cache=scratch.ScratchCache())
        sess.run(model.init)
        metadata = tf1.RunMetadata()
        sess.run([model.train, model.loss], model.feed(48),
                 options=tf1.RunOptions(trace_level=tf1.RunOptions.SOFTWARE_TRACE),
                 run_metadata=metadata)
    # The plain step's node names are the ops' own: no copy scope prefixes them.
    in_step = measured_scratch(metadata, frozenset(view.nodes), "tfmem/none")
    assert in_step
    for name in [n for n in view.nodes if view.nodes[n].type.startswith("Conv2D")]:
        ours, real = found.get(name, 0), in_step.get(name, 0)
        assert abs(real - ours) <= 0.05 * real + (16 << 10), (name, real, ours)


def test_session_predictions_include_scratch():
    model = models.convnet()
    feed = model.feed(48)
    with tf1.Session(graph=model.graph, config=CONFIG) as sess:
        tfs = tfmem.TFMemSession(sess, partition_size=20)
        trace = tfs.simulate([model.train, model.loss], feed)
        assert any(p.scratch > 64 << 10 for p in trace.partitions)
        tfs.run(model.init)
        before = tfs.run(model.loss, feed)
        tfs.run([model.train, model.loss], feed)
        assert np.isfinite(before)
