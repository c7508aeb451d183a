"""experiments/partition_graphs.py: a session graph per partition (issue 12).

The cut itself is checked on a local session (what a callable reaches, run on
a graph of its own, gives what the whole graph gives); the experiment is run
once on a small graph in its private network, and its partitioned steps on
sessions of their own must equal plain `Session.run` bit for bit.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "experiments"))

import local_cluster  # noqa: E402  pylint: disable=wrong-import-position
import partition_graphs  # noqa: E402  pylint: disable=wrong-import-position

tf1 = tf.compat.v1


def test_a_cut_graph_holds_only_what_the_callable_reaches_and_computes_the_same():
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        v = tf1.get_variable("v", [4, 4], use_resource=True,
                             initializer=tf1.glorot_uniform_initializer(seed=1))
        h = tf.nn.relu(tf.matmul(x, v), name="h")
        fed = tf1.placeholder(tf.float32, [None, 4], name="fed")  # a partition input
        out = tf.reduce_sum(tf.sin(fed) * h, name="out")
        for i in range(50):  # ops the callable does not reach
            tf.constant(float(i), name=f"unrelated{i}")
        init = tf1.global_variables_initializer()
    options = config_pb2.CallableOptions(feed=[x.name, fed.name], fetch=[out.name])
    graph_def = partition_graphs.reached_graph_def(graph, options)
    names = {node.name for node in graph_def.node}
    assert {"x", "fed", "v", "h", "out"} <= names, names
    assert not any(name.startswith("unrelated") or "Assign" in name or "Initializer" in name
                   for name in names), names
    values = [np.random.RandomState(0).randn(3, 4).astype(np.float32),
              np.random.RandomState(1).randn(3, 4).astype(np.float32)]
    with tf1.Session(graph=graph) as whole:
        whole.run(init)
        expected = whole.run(out, {x: values[0], fed: values[1]})
        v_value = whole.run(v)
    own = tf.Graph()
    with own.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
        handle = own.get_tensor_by_name("v:0")
        assign = tf.raw_ops.AssignVariableOp(resource=handle, value=tf.constant(v_value))
    with tf1.Session(graph=own) as sess:
        sess.run(assign)
        call = sess._make_callable_from_options(options)  # pylint: disable=protected-access
        assert call(*values)[0] == expected


def test_a_fed_tensor_that_is_not_a_placeholder_is_refused():
    graph = tf.Graph()
    with graph.as_default():
        a = tf.constant(1.0, name="a")
        b = tf.math.add(a, 1.0, name="b")
        c = tf.math.multiply(b, 2.0, name="c")
    with pytest.raises(ValueError, match="b:0 is fed but not a placeholder"):
        partition_graphs.reached_graph_def(graph, config_pb2.CallableOptions(
            feed=[b.name], fetch=[c.name]))


def test_partitions_on_sessions_of_their_own_equal_plain_and_share_state(tmp_path):
    problem = local_cluster.private_network_problem()
    if problem:
        pytest.skip(f"the in-process server needs a private network namespace: {problem}")
    out = tmp_path / "partition_graphs.json"
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "partition_graphs.py"), "--graphs", "1500",
         "--layers", "6", "--repeats", "1", "--steps", "2", "--no-warmup", "--time-limit",
         "150", "--out", str(out)], capture_output=True, text=True, timeout=180, env=env,
        check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["complete"] and data["tiny_check"]["ok"], data["tiny_check"]
    (row,) = data["rows"]
    for arm in ("local", "per-graph", "grpc"):
        assert row[arm]["losses_equal_plain"], (arm, row[arm]["losses"], row["plain_losses"])
        assert len(row[arm]["losses"]) == 3
    own = row["per-graph"]["own_graph_ops"]
    assert len(own) == row["per-graph"]["callables"]
    assert max(own) * 5 < row["per-graph"]["session_graph_ops"], own  # each graph is small
