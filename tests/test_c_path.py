"""Session.run's C path (run/executing/c_path.py): a call built ahead holds its
executor, constants included, before it first runs, and building it runs nothing.

In a fresh process with a BFC allocator (far above the graph), so that TensorFlow's
own figures show what the executor holds.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20

CHILD = r"""
import json
import tfmem
tfmem.emulate_accelerator(256)
import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2
from tfmem.run.executing import c_path
tf1 = tf.compat.v1

def current():
    return tf.config.experimental.get_memory_info("CPU:0")["current"]

graph = tf.Graph()
with graph.as_default():
    x = tf1.placeholder(tf.float32, [1024, 256])
    # Grappler folds the gradient of the mean into a [1024, 256] constant
    gradient, = tf.gradients(tf.reduce_mean(x * x), [x])
    counter = tf1.get_variable("counter", [], tf.int32, use_resource=True,
                               initializer=tf1.zeros_initializer())
    count = counter.assign_add(1, read_value=False)
session = tf1.Session(graph=graph)
session.run(counter.initializer)
options = config_pb2.CallableOptions(feed=[x.name], fetch=[gradient.name], target=[count.name])
call = c_path.RunPathCallable(session, options)
traced = config_pb2.CallableOptions()
traced.CopyFrom(options)
traced.run_options.trace_level = config_pb2.RunOptions.SOFTWARE_TRACE
before = current()
built = call.build()
held = current() - before
counted_by_build = int(session.run(counter))
value = np.random.default_rng(0).normal(size=(1024, 256)).astype(np.float32)
result = np.array(call(value)[0])  # copies: a fetched array can hold TensorFlow's buffer
metadata = config_pb2.RunMetadata()
traced_result = np.array(c_path.RunPathCallable(session, traced)(value, run_metadata=metadata)[0])
held_after_calls = current() - before
counted_by_calls = int(session.run(counter))
plain = session.run(gradient, {x: value})
print(json.dumps({"built": built, "held": held, "counted_by_build": counted_by_build,
                  "counted_by_calls": counted_by_calls,
                  "equal": bool(np.array_equal(result, plain)),
                  "traced equal": bool(np.array_equal(traced_result, plain)),
                  "traced": len(metadata.step_stats.dev_stats) > 0,
                  "held after calls": held_after_calls}))
"""


@pytest.mark.parametrize("onednn", ["0", "1"])
def test_a_call_built_ahead_holds_its_executor_and_ran_nothing(onednn):
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          cwd=ROOT, timeout=300,
                          env=dict(os.environ, TF_ENABLE_ONEDNN_OPTS=onednn,
                                   TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["built"], result
    # the executor exists: its folded constant is on the device before any call
    assert result["held"] >= MIB, result
    # building ran nothing (the target is a stateful op); each call ran it once
    assert result["counted_by_build"] == 0 and result["counted_by_calls"] == 2, result
    assert result["equal"] and result["traced equal"] and result["traced"], result
    # a traced call of the same feeds, fetches and targets builds no second executor
    # (which would hold a second copy of the constant)
    assert result["held after calls"] - result["held"] < MIB // 2, result
