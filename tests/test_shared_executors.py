"""Steps of one plan share TensorFlow's executors, whatever their run options.

TensorFlow builds a call's executors (prune, place, optimise the whole session
graph) once per session callable, and once per feed/fetch/target names for
`Session.run`.  With `Options(calls_by_name=True)` a partition runs by name
(run/executing/c_path.py), so a step
tfmem measures (allocation tracking on), a step the user traces and an untraced
step run on the executors the first step built: `StepStats.executors_built` is
0 on every later step.  A partition whose originals read connected tensors
stays a session callable per run options.  Every step's values are checked
against plain Session.run of the same graph.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from conftest import assert_same_result, tfmem_config, run_worker

tf1 = tf.compat.v1

TRACES = (None, tf1.RunOptions(trace_level=tf1.RunOptions.SOFTWARE_TRACE),
          tf1.RunOptions(trace_level=tf1.RunOptions.FULL_TRACE, output_partition_graphs=True),
          None)


def _chain(dropout):
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 16], name="x")  # dropout reads its shape
        w = tf1.Variable(np.full((16, 16), 0.1, np.float32), name="w")
        h = x
        for i in range(8):
            h = tf.tanh(tf.matmul(h, w), name=f"h{i}")
            if dropout and i == 4:  # reads a computed shape: an original, connected
                h = tf1.nn.dropout(h, rate=0.5, seed=3)
        loss = tf.reduce_sum(h, name="loss")
        train = tf1.train.GradientDescentOptimizer(0.01).minimize(loss)
        init = tf1.global_variables_initializer()
    return g, x, loss, train, init


def _steps(dropout, closed_at_teardown):
    """Per step of TRACES: (plain values, tfmem values, StepStats); the CompileStats."""
    runs = []
    for wrap in (False, True):
        g, x, loss, train, init = _chain(dropout)
        sess, = closed_at_teardown(tf1.Session(graph=g, config=tfmem_config()))
        sess.run(init)
        # measure="off": the steps' run options are the ones below wherever the allocator
        # keeps figures (test_measured_and_unmeasured_steps_share_executors measures)
        run = tfmem.TFMemSession(sess, partition_size=6, options=tfmem.Options(
            measure="off", calls_by_name=True)) if wrap else sess
        feed = {x: np.linspace(-1, 1, 128, dtype=np.float32).reshape(8, 16)}
        values, stats = [], []
        for options in TRACES:
            values.append(run.run([train, loss], feed, options=options,
                                  run_metadata=tf1.RunMetadata() if options else None))
            stats.append(run.last_step if wrap else None)
        runs.append((values, stats, run.last_compile if wrap else None))
    (expected, _, _), (got, stats, compiled) = runs
    for want, have in zip(expected, got):
        assert_same_result(want, have, rtol=0, atol=0)
    return stats, compiled


def test_traced_and_untraced_steps_share_executors(closed_at_teardown):
    stats, compiled = _steps(False, closed_at_teardown)
    assert stats[0].calls > 1
    assert compiled.run_by_name == compiled.callables == stats[0].calls
    assert [s.executors_built for s in stats] == [stats[0].calls, 0, 0, 0]


def test_a_partition_with_connected_tensors_is_a_callable_per_run_options(closed_at_teardown):
    stats, compiled = _steps(True, closed_at_teardown)
    callables = compiled.callables - compiled.run_by_name
    assert callables >= 1 and compiled.run_by_name >= 1
    # the first step's callables were made at compile; each new run options makes its own
    assert [s.executors_built for s in stats] == [compiled.run_by_name, callables,
                                                  callables, 0]


_MEASURED = r"""
import json
import numpy as np
import tensorflow as tf
import tfmem
from tfmem.cli import models
tf1 = tf.compat.v1
config = tfmem.session_config(tf1.ConfigProto(intra_op_parallelism_threads=1,
                                              inter_op_parallelism_threads=2))
model = models.resnet(blocks=(1, 1, 1), image=16)
feed, fetches = model.feed(8), [model.train, model.loss]
out = {"plain": [], "steps": []}
plain = tf1.Session(graph=model.graph, config=config)
plain.run(model.init)
sess = tf1.Session(graph=model.graph, config=config)
sess.run(model.init)
# measures its first steps, then samples
tfs = tfmem.TFMemSession(sess, partition_size=40, options=tfmem.Options(calls_by_name=True))
for _ in range(7):
    out["plain"].append(float(plain.run(fetches, feed)[1]))
    loss = float(tfs.run(fetches, feed)[1])
    s = tfs.last_step
    out["steps"].append(dict(loss=loss, measured=s.measured, built=s.executors_built,
                             calls=s.calls, peaks=list(s.partition_peak_bytes or []),
                             partitions=s.partitions, scratch=sorted(s.kernel_scratch)))
out["compiled"] = [tfs.last_compile.callables, tfs.last_compile.run_by_name]
print("TFMEM-RESULTS " + json.dumps(out))
"""


@pytest.mark.parametrize("onednn", ["0", "1"])
def test_measured_and_unmeasured_steps_share_executors(onednn):
    """Where TensorFlow keeps figures, the first steps are measured (traced) and later ones
    not: the step after measuring stops builds nothing, and the measured steps still read
    each partition's peak and kernel scratch from the step statistics."""
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=onednn, TF_CPP_MIN_LOG_LEVEL="2",
               TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPU_BFC_MEM_LIMIT_IN_MB="4096")
    out = run_worker(_MEASURED, env, timeout=300)
    steps = out["steps"]
    assert [s["loss"] for s in steps] == out["plain"]
    measured = [s["measured"] for s in steps]
    assert measured[0] and not all(measured), measured  # else the check proves nothing
    first = measured.index(False)
    assert all(measured[:first]) and not any(measured[first:]), measured
    callables, by_name = out["compiled"]
    assert callables == by_name == steps[0]["calls"] > 1
    assert [s["built"] for s in steps] == [by_name] + [0] * (len(steps) - 1)
    for step in steps[:first]:  # every partition's peak read from its own ops' statistics
        assert len(step["peaks"]) == step["partitions"] and all(step["peaks"])
    if onednn == "0":  # im2col buffers of the convolution gradients
        assert any(s["scratch"] for s in steps[:first])
