"""What TensorFlow does to a step's memory besides running its ops, in the simulator.

Each test measures TensorFlow's own figures in a fresh process (a BFC allocator
far above the step, the kernel path set explicitly, pinned thread pools) and
sets tfmem's prediction beside them:

* Grappler merges equal ops (common subgraph elimination): two equal transposes
  of one input leave one buffer, not two (`tfmem/memory/dedup.py`);
* oneDNN's max pooling returns a workspace the graph's MaxPool does not have,
  and its gradient, given the workspace, needs no scratch; without it (the
  forward op in another partition) the gradient allocates scratch
  (`tfmem/memory/workspace.py`);
* TensorFlow's executor does not run a step depth first: in an unrolled RNN the
  loss's gradient reaches every frame at once and the backward pass runs as a
  wave across frames (`tfmem/memory/op_order.py`);
* two views of one buffer kept for later partitions (an Identity and a Reshape
  of one tensor, as an Add's gradient makes) hold it once, not twice; a kept
  input's last reader writes into it once its deleter ran (forwarding);
* a kernel that allocates scratch before its outputs (oneDNN's pooling gradient
  without its workspace) leaves its output a different chunk of the allocator
  than one allocating them after (`scratch.scratch_before_outputs`).
"""

import json
import os
import subprocess
import sys

import pytest

from tfmem.cli.child_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20

EQUAL_OPS = r"""
import json, sys
import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
import tfmem
from tfmem.run.placement import accelerator

def build():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [512, 1024], name="x")
        s1 = tf.transpose(x, name="s1")  # equal ops: Grappler keeps one
        s2 = tf.transpose(x, name="s2")
        p = tf.matmul(s1, tf.constant(np.full((512, 64), 0.5, np.float32)))
        q = tf.matmul(s2, tf.constant(np.full((512, 64), 0.25, np.float32)))
        out = tf.reduce_sum(tf.concat([p, q, s1, s2], 1))
    return graph, x, out

figures = {}
for merge in (True, False):
    graph, x, out = build()
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                      inter_op_parallelism_threads=1)
    if not merge:  # the three passes that merge equal ops off (see dedup)
        config.graph_options.optimizer_options.opt_level = config_pb2.OptimizerOptions.L0
        rewrite = config.graph_options.rewrite_options
        rewrite.common_subgraph_elimination = rewriter_config_pb2.RewriterConfig.OFF
        rewrite.arithmetic_optimization = rewriter_config_pb2.RewriterConfig.OFF
    sess = tf.compat.v1.Session(graph=graph, config=config)
    feed = {x: np.ones((512, 1024), np.float32)}
    for _ in range(2):
        plain = sess.run(out, feed)
    start = accelerator.device_memory("CPU:0")["current"]
    accelerator.reset_peak("CPU:0")
    metadata = config_pb2.RunMetadata()
    sess.run(out, feed, run_metadata=metadata,
             options=config_pb2.RunOptions(trace_level=config_pb2.RunOptions.FULL_TRACE))
    measured = accelerator.device_memory("CPU:0")["peak"] - start
    # TensorFlow's own records: the bytes its live tensors requested at the peak.
    events = sorted((r.alloc_micros, r.alloc_bytes, n.node_name)
                    for d in metadata.step_stats.dev_stats for n in d.node_stats
                    for m in n.memory for r in m.allocation_records)
    requested = {n.node_name: sum(o.tensor_description.allocation_description.requested_bytes
                                  for o in n.output)
                 for d in metadata.step_stats.dev_stats for n in d.node_stats}
    live, current, best = {}, 0, (0, {})
    for _, nbytes, name in events:
        live[name] = live.get(name, 0) + nbytes
        current += nbytes
        if current > best[0]:
            best = (current, {k for k, v in live.items() if v > 0})
    transposes = sum(1 for d in metadata.step_stats.dev_stats for n in d.node_stats
                     if "= Transpose(" in n.timeline_label)
    # the copies as the plain step runs its ops
    tfs = tfmem.TFMemSession(sess, partition_size=100000,
                             options=tfmem.Options(chain_copies=False))
    trace = tfs.simulate(out, feed)
    figures["merged" if merge else "apart"] = dict(
        measured=measured, requested=sum(requested[name] for name in best[1]),
        transposes=transposes, predicted=trace.peak_device - trace.state_bytes,
        predicted_chunks=trace.peak_device_chunks - trace.state_bytes,
        tfmem_equals_plain=bool(np.array_equal(tfs.run(out, feed), plain)))
    # chained copies: equal ops wait for different ops
    chained = tfmem.TFMemSession(sess, partition_size=100000,
                                 options=tfmem.Options(measure="every"))
    for _ in range(3):
        got = chained.run(out, feed)
    trace = chained.simulate(out, feed)
    figures["chained" if merge else "chained_apart"] = dict(
        measured=chained.last_step.device_peak_bytes - start,
        predicted=trace.peak_device - trace.state_bytes,
        predicted_chunks=trace.peak_device_chunks - trace.state_bytes,
        tfmem_equals_plain=bool(np.array_equal(got, plain)))
    sess.close()
print(json.dumps(figures))
"""

MAX_POOL = r"""
import json
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2
import tfmem
from tfmem.cli import models
from tfmem.memory.sizing import Sizing
from tfmem.run.placement import accelerator

POOL, GRAD = "MaxPool2d", "gradients/MaxPool2d_grad/MaxPoolGrad"
model = models.convnet()
config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)
sess = tf.compat.v1.Session(graph=model.graph, config=config)
tfmem.TFMemSession(sess, partition_size=100000).run(model.init)
feed = model.feed(48)
fetches = [model.train, model.loss]
for _ in range(2):
    sess.run(fetches, feed)
metadata = config_pb2.RunMetadata()
sess.run(fetches, feed, run_metadata=metadata,
         options=config_pb2.RunOptions(trace_level=config_pb2.RunOptions.FULL_TRACE))
extra_outputs = {}  # TensorFlow's own: bytes of outputs past the op's own, per node
for device in metadata.step_stats.dev_stats:
    for node in device.node_stats:
        try:
            own = len(model.graph.get_operation_by_name(node.node_name).outputs)
        except KeyError:  # TensorFlow's own nodes (_SOURCE, args)
            continue
        extra_outputs[node.node_name] = sum(
            o.tensor_description.allocation_description.requested_bytes
            for o in node.output if o.slot >= own)
pools = {op.name: op.outputs[0].consumers() for op in model.graph.get_operations()
         if op.type == "MaxPool"}
rows = {}
for size in (100000, 50):
    tfs = tfmem.TFMemSession(sess, partition_size=size, options=tfmem.Options(measure="every"))
    for _ in range(3):
        tfs.run(fetches, feed)
    plan = tfs.plan(fetches, feed)
    together = any(POOL in p.ops and GRAD in p.ops for p in plan.partitions)
    sizing = Sizing.of(model.graph, plan.view, {t.name: v.shape for t, v in feed.items()}, sess)
    trace = tfs.simulate(fetches, feed)
    rows[size] = dict(together=together, grad_scratch=tfs.last_step.kernel_scratch.get(GRAD, 0),
                      partitions=len(plan.partitions), measured=tfs.last_step.device_peak_bytes,
                      predicted_chunks=trace.peak_device_chunks)
gradients = {pool: [c.name for c in readers if c.type == "MaxPoolGrad"]
             for pool, readers in pools.items()}
print(json.dumps(dict(extra_outputs=extra_outputs, rows=rows, gradients=gradients,
                      extra=sizing.workspaces.extra, paired=sizing.workspaces.paired,
                      calibrated=sizing.scratch.get(GRAD, 0))))
"""


EARLY_SCRATCH = r"""
import json
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2
import tfmem
from tfmem.cli import models
from tfmem.memory.sizing import Sizing

POOL, GRAD = "MaxPool2d", "gradients/MaxPool2d_grad/MaxPoolGrad"
model = models.vgg(widths=(16, 16, 24, 24), image=32)
config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)
sess = tf.compat.v1.Session(graph=model.graph, config=config)
tfmem.TFMemSession(sess, partition_size=100000).run(model.init)
feed, fetches = model.feed(16), [model.train, model.loss]
tfs = tfmem.TFMemSession(sess, partition_size=50, measure="every")
measured = []
for _ in range(3):
    tfs.run(fetches, feed)
    measured.append(tfs.last_step.device_peak_bytes)
plan = tfs.plan(fetches, feed)
trace = tfs.simulate(fetches, feed)
sizing = Sizing.of(model.graph, plan.view, {t.name: v.shape for t, v in feed.items()}, sess)
metadata = config_pb2.RunMetadata()
tfs.run(fetches, feed, run_metadata=metadata,
        options=config_pb2.RunOptions(trace_level=config_pb2.RunOptions.FULL_TRACE))
# TensorFlow's own records of the gradient's kernel: the bytes it allocated before the
# chunk of its output, and still held when it allocated that.
node = next(n for d in metadata.step_stats.dev_stats for n in d.node_stats
            if n.node_name.endswith("/" + GRAD))
output = node.output[0].tensor_description.allocation_description.allocated_bytes
records = [r.alloc_bytes for m in node.memory for r in m.allocation_records]
first = records.index(output)
before = sum(b for b in records[:first] if b > 0) + sum(b for b in records[:first] if b < 0)
print(json.dumps(dict(
    apart=not any(POOL in p.ops and GRAD in p.ops for p in plan.partitions),
    measured=measured, predicted_chunks=trace.peak_device_chunks,
    scratch=sizing.scratch.get(GRAD, 0), early=sizing.early_scratch.get(GRAD, 0),
    recorded_before_output=before)))
"""


# DeepSpeech's step (experiments/deepspeech.py, 32 frames, batch 128) as one TFMemSession
# of `size` ops per partition under tfmem's session config, one thread per pool.
DEEPSPEECH_SESSION = r"""
import types
import tensorflow as tf
import tfmem
from experiments import deepspeech

def deepspeech_session(size):
    args = types.SimpleNamespace(features=26, hidden=128, classes=29, seed=0, batch_size=128,
                                 learning_rate=0.001)
    model = deepspeech.build(tf, 32, args)
    config = tfmem.session_config(tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                                            inter_op_parallelism_threads=1))
    sess = tf.compat.v1.Session(graph=model.graph, config=config)
    tfmem.TFMemSession(sess, partition_size=100000).run(model.init)
    tfs = tfmem.TFMemSession(sess, partition_size=size, measure="every")
    return model, sess, tfs, model.feed, [model.train_op, model.loss]
"""


WAVE = DEEPSPEECH_SESSION + r"""
import json
from tensorflow.core.protobuf import config_pb2
from tfmem.memory import op_order, simulate as simulator

def measured_step(chained):
    # (tfs, fetches, feed, the peak TensorFlow's records hold) of a session whose copies
    # are chained or left to the executor
    model, sess, _, feed, fetches = deepspeech_session(100000)
    tfs = tfmem.TFMemSession(sess, partition_size=100000,
                             options=tfmem.Options(measure="every", chain_copies=chained))
    for _ in range(2):
        tfs.run(fetches, feed)
    metadata = config_pb2.RunMetadata()
    tfs.run(fetches, feed, run_metadata=metadata,
            options=config_pb2.RunOptions(trace_level=config_pb2.RunOptions.FULL_TRACE))
    # TensorFlow's own records: the step's allocations and frees in time order.
    events = sorted((r.alloc_micros, r.alloc_bytes) for d in metadata.step_stats.dev_stats
                    for n in d.node_stats for m in n.memory for r in m.allocation_records)
    current = measured = 0
    for _, nbytes in events:
        current += nbytes
        measured = max(measured, current)
    return tfs, fetches, feed, measured

tfs, fetches, feed, measured = measured_step(False)
predicted = {}
emulated = simulator.partition_orders
for label, orders in (("simulator", emulated),
                      ("depth first", lambda view, ops, _, **__: [op_order.dependency_order(view, ops)])):
    simulator.partition_orders = orders
    trace = tfs.simulate(fetches, feed)
    predicted[label] = trace.peak_device - trace.state_bytes
simulator.partition_orders = emulated
tfs, fetches, feed, chained = measured_step(True)
trace = tfs.simulate(fetches, feed)
print(json.dumps(dict(measured=measured, predicted=predicted,
                      partitions=len(tfs.plan(fetches, feed).partitions),
                      chained=dict(measured=chained,
                                   predicted=trace.peak_device - trace.state_bytes))))
"""


NUMBERING = DEEPSPEECH_SESSION + r"""
import json
from tensorflow.core.protobuf import config_pb2
from tfmem.memory import op_order

model, sess, _, feed, fetches = deepspeech_session(100000)
# the copies as TensorFlow's executor numbers and runs them
tfs = tfmem.TFMemSession(sess, partition_size=100000, options=tfmem.Options(chain_copies=False))
metadata = config_pb2.RunMetadata()
tfs.run(fetches, feed, run_metadata=metadata,
        options=config_pb2.RunOptions(output_partition_graphs=True))
plan = tfs.plan(fetches, feed)
ops = plan.partitions[0].ops
# The graph TensorFlow's executor ran, its nodes in id order; tfmem's copies are
# named tfmem/plan<k>/p0/<op>.
names = [n.name for g in metadata.partition_graphs for n in g.node]
copies = [n.rsplit("/p0/", 1)[-1] for n in names if "/p0/" in n]
ids = op_order._node_ids(plan.view, ops, plan.view.originals)
numbered = [n for n in copies if n in ids]
print(json.dumps(dict(
    copies=len(numbered), in_id_order=sorted(numbered, key=ids.get) == numbered,
    folded=sorted(op_order.folded_constants(plan.view, ops)),
    not_run=sorted(set(ops) - set(copies) - set(names)))))
"""


KEPT_VIEWS = r"""
import json
import numpy as np
import tfmem
tfmem.emulate_accelerator(1024)
import tensorflow as tf
tf1 = tf.compat.v1
graph = tf.Graph()
with graph.as_default():
    x = tf1.placeholder(tf.float32, [None, 1024], name="x")
    t = tf.tanh(x)  # 4 MiB, viewed by a and b
    a = tf.identity(t, name="a")
    b = tf.reshape(t, [-1, 1024], name="b")
    r = tf.reduce_sum(a, axis=1, name="r")
    for i in range(6):
        r = tf.cos(r, name=f"c{i}")
    out = tf.reduce_sum(tf.reshape(r, [-1, 1]) * tf.cos(b, name="late"))
config = tfmem.session_config(tf1.ConfigProto(intra_op_parallelism_threads=1,
                                              inter_op_parallelism_threads=1))
tfs = tfmem.TFMemSession(tf1.Session(graph=graph, config=config), partition_size=2,
                         swap="none", options=tfmem.Options(measure="off"))
feed = {x: np.ones((1024, 1024), np.float32)}
peaks = []
for _ in range(3):
    tf.config.experimental.reset_memory_stats("CPU:0")
    base = tf.config.experimental.get_memory_info("CPU:0")["current"]
    tfs.run(out, feed)
    peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - base)
plan, trace = tfs.plan(out, feed), tfs.simulate(out, feed)
first = plan.partitions[0]
print(json.dumps(dict(
    outputs=sorted(first.ops), kept=sorted(t for t in first.outputs if plan.transfer(t).kept),
    readers=sorted({k for n in ("Tanh:0", "b:0") for k in plan.transfer(n).consumers}),
    measured=min(peaks), predicted=trace.peak_device_requested,
    predicted_chunks=trace.peak_device_chunks)))
"""


def _child(script, onednn):
    env = child_env(onednn=onednn)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_equal_ops_are_merged_as_grappler_merges_them():
    """Two equal transposes of a 2 MiB input, both read at the peak: TensorFlow runs one
    when Grappler merges them (the default) and two when the session turns the merge
    off; the prediction follows the session's config: its requested bytes are the
    requests TensorFlow's records hold at the peak, its chunk figure TensorFlow's peak.
    TFMemSession's chained copies are never merged."""
    figures = _child(EQUAL_OPS, onednn=False)
    merged, apart = figures["merged"], figures["apart"]
    # Chained copies (op_order.chained_order) are not merged, with Grappler on or off:
    # predicted as the apart step, and measured so (within 5 %: 13.11 MiB in chunks
    # against 13.63 measured after the plain steps' chunks; merged would read 2 MiB less).
    for case in (figures["chained"], figures["chained_apart"]):
        assert case["tfmem_equals_plain"], figures
        assert case["predicted"] == apart["predicted"], figures
        assert abs(case["predicted_chunks"] - case["measured"]) <= 0.05 * case["measured"], \
            figures
    assert merged["tfmem_equals_plain"] and apart["tfmem_equals_plain"]
    assert (merged["transposes"], apart["transposes"]) == (1, 2), figures
    assert apart["requested"] - merged["requested"] == 2 * MIB, figures
    for case in (merged, apart):
        assert case["predicted"] == case["requested"], figures
        assert abs(case["predicted_chunks"] - case["measured"]) <= 0.02 * case["measured"], \
            figures


@pytest.mark.parametrize("onednn", [False, True])
@pytest.mark.parametrize("reader", ["sum", "sine"])
@pytest.mark.slow
def test_two_kept_views_of_one_buffer_hold_it_once(onednn, reader):
    """Partition 0 computes tanh (4 MiB) and a Reshape of it, both kept for partition
    1, where an Identity and a cosine read them: one buffer, so partition 1 holds 4 MiB
    and its cosine's 4 MiB, the step's peak.  Counted once per view, the prediction read
    12 MiB against TensorFlow's 8.  With a sine between the Identity and the sum, the
    sine, last reader of the buffer once its deleter ran, writes into it (forwarding;
    predicted 12 MiB before the simulator counted it)."""
    script = KEPT_VIEWS if reader == "sum" else KEPT_VIEWS.replace(
        "tf.reduce_sum(a, axis=1", "tf.reduce_sum(tf.sin(a), axis=1")
    figures = _child(script, onednn=onednn)
    assert figures["outputs"] == ["Tanh", "b"] and figures["kept"] == ["Tanh:0", "b:0"], figures
    assert figures["readers"] == [1], figures
    assert abs(figures["predicted"] - figures["measured"]) <= 0.02 * figures["measured"], figures
    assert abs(figures["predicted_chunks"] - figures["measured"]) <= 0.02 * figures["measured"], \
        figures


@pytest.mark.slow
def test_onednn_max_pooling_workspace_and_paired_gradient_scratch():
    """oneDNN's max pooling: the workspace tfmem measures is the second output TensorFlow's
    step statistics show for the plain step's MaxPool; the gradient's scratch is what the
    step measured: none beside its forward op (one partition), the calibrated figure when
    the plan puts them in different partitions.  Without oneDNN there is no workspace."""
    onednn = _child(MAX_POOL, onednn=True)
    pool, grad = "MaxPool2d", "gradients/MaxPool2d_grad/MaxPoolGrad"
    assert len(onednn["gradients"]) == 3 and onednn["extra_outputs"][pool] > 0, onednn
    # Every op's extra outputs as TensorFlow's step statistics show them, and no other op.
    assert onednn["extra"] == {k: v for k, v in onednn["extra_outputs"].items() if v}, onednn
    assert set(onednn["extra"]) == set(onednn["gradients"]), onednn
    # Each pooling gradient (and nothing else) uses its forward op's workspace.
    assert {r: f for r, (f, _) in onednn["paired"].items()} == {
        readers[0]: forward for forward, readers in onednn["gradients"].items()}, onednn
    whole, split = onednn["rows"]["100000"], onednn["rows"]["50"]
    assert whole["together"] and not split["together"], onednn
    assert onednn["paired"][grad][1] == whole["grad_scratch"] == 0, onednn
    # Within 2 %: with the copies chained (op_order.chained_order) the split plan's gradient
    # measured 18.5 KiB (1.5 %) above its calibration here, after the one-partition plan's
    # steps, and the calibrated figure to the byte in a process of its own.
    calibrated = onednn["calibrated"]
    assert calibrated > 0 and abs(split["grad_scratch"] - calibrated) <= 0.02 * calibrated, onednn
    # The chunk figure of both plans within 5 % of the step tfmem measured.
    for row in (whole, split):
        assert abs(row["predicted_chunks"] - row["measured"]) <= 0.05 * row["measured"], onednn
    eigen = _child(MAX_POOL, onednn=False)
    assert not any(eigen["extra_outputs"].values()), eigen
    assert eigen["extra"] == {} and eigen["paired"] == {}, eigen


@pytest.mark.parametrize("onednn", [False, True], ids=["eigen", "onednn"])
def test_scratch_a_kernel_allocates_before_its_outputs_is_replayed_before_them(onednn):
    """A VGG-like net whose first pooling gradient runs in another partition than its
    forward op: the gradient allocates its scratch before its output (TensorFlow's
    allocation records of the step show it; with oneDNN, twice its pooled input, as it
    has no workspace), and with oneDNN that output takes a free chunk almost twice its
    size.  Replayed after the output, the chunk figure read 14.6 % under the step's
    peak with oneDNN; replayed in the kernel's own order, within 2 % on both paths."""
    figures = _child(EARLY_SCRATCH, onednn=onednn)
    assert figures["apart"], figures
    # Both kernel paths' pooling gradients allocate all their scratch first (TensorFlow's
    # own kernel its argmax indices), as the calibration measured it.
    assert figures["scratch"] > 0, figures
    assert figures["early"] == figures["recorded_before_output"] == figures["scratch"], figures
    measured = figures["measured"][-1]
    assert abs(figures["predicted_chunks"] - measured) <= 0.02 * measured, figures


def test_merging_equal_ops_never_adds_memory_and_stays_within_a_partition():
    """Pure: on the unrolled RNN (two directions slicing one input), merging equal ops lowers
    the one-partition peak by the merged slices and never raises any partition's peak; with
    one op per partition nothing is merged (ops of different partitions stay apart)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tfmem.cli import models  # pylint: disable=import-outside-toplevel
    from tfmem.memory import dedup  # pylint: disable=import-outside-toplevel
    from tfmem.memory.shapes import resolve_shapes  # pylint: disable=import-outside-toplevel
    from tfmem.memory.simulate import simulate  # pylint: disable=import-outside-toplevel
    from tfmem.plan.analyse import analyse  # pylint: disable=import-outside-toplevel
    from tfmem.plan.build import make_plan  # pylint: disable=import-outside-toplevel

    model = models.unrolled_rnn(steps=16)
    x, y = model.inputs
    view = analyse([model.loss], [model.train], [x, y])
    shapes = resolve_shapes(model.graph, view, {x.name: (256, 16, 64), y.name: (256,)})
    signatures = dedup.signatures(model.graph, view)
    config = tf.compat.v1.ConfigProto()
    config.graph_options.optimizer_options.opt_level = tf.compat.v1.OptimizerOptions.L0
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    assert dedup.signatures(model.graph, view, tf.compat.v1.Session(graph=model.graph,
                                                                    config=config)) == {}
    for size in (100000, 40, 1):
        plan = make_plan(view, size)
        apart = simulate(plan, shapes)
        merged = simulate(plan, shapes, signatures=signatures)
        assert all(m.device_peak <= a.device_peak
                   for m, a in zip(merged.partitions, apart.partitions)), size
        if size == 1:
            assert merged == apart
    whole = make_plan(view, 100000)
    slice_bytes = 256 * 64 * 4  # one time step's x[:, t, :]
    saved = simulate(whole, shapes).peak_device - simulate(
        whole, shapes, signatures=signatures).peak_device
    assert saved == 16 * slice_bytes  # the backward direction's 16 slices


def test_a_search_share_predicts_each_candidate_as_a_simulation_of_its_own():
    """Pure: a budget search predicts its candidate plans with one `CandidateShare` (the
    working sets of partitions met before, each op's view and merge facts).  On the
    unrolled RNN with equal ops merged, over sizes and swap distances in the order a
    search meets them, each prediction through the share is the one a simulation of that
    plan alone makes: nothing the share holds is stale for the next candidate."""
    from tfmem.cli import models  # pylint: disable=import-outside-toplevel
    from tfmem.memory import dedup  # pylint: disable=import-outside-toplevel
    from tfmem.memory.shapes import resolve_shapes  # pylint: disable=import-outside-toplevel
    from tfmem.memory.simulate import (  # pylint: disable=import-outside-toplevel
        CandidateShare, TensorSizes, simulate)
    from tfmem.plan.analyse import analyse  # pylint: disable=import-outside-toplevel
    from tfmem.plan.build import make_plan  # pylint: disable=import-outside-toplevel
    from tfmem.plan.swap import SwapPolicy  # pylint: disable=import-outside-toplevel

    model = models.unrolled_rnn(steps=8)
    x, y = model.inputs
    view = analyse([model.loss], [model.train], [x, y])
    options = dict(early_frees=False, signatures=dedup.signatures(model.graph, view),
                   chunks=True, concurrent_ops=2)
    merged_any = False
    for batch in (64, 1):  # at batch 1 the bias gradients' sums reduce nothing: views
        shapes = resolve_shapes(model.graph, view, {x.name: (batch, 8, 64), y.name: (batch,)})
        share = CandidateShare(TensorSizes(view, shapes))
        for size in (100000, 200, 100, 150, 40, 7, 1):
            for distance in (2, 0):  # every transfer may be swapped, so distances differ
                plan = make_plan(view, size, SwapPolicy(swap_distance=distance, min_bytes=0))
                shared = simulate(plan, shapes, share=share, **options)
                alone = simulate(plan, shapes, **options)
                assert shared == alone, (batch, size, distance)
                merged_any |= alone != simulate(plan, shapes,
                                                **dict(options, signatures=None))
    assert merged_any  # the merge facts were in play
    assert share.working_sets  # and partitions met again were taken from the share


@pytest.mark.slow
def test_the_backward_wave_of_an_unrolled_rnn_is_in_the_prediction():
    """DeepSpeech at 32 frames (the experiment's model) as one partition, one thread per
    pool, both kernel paths: its step allocates about a quarter more than a depth-first
    walk of the graph holds at once, because TensorFlow's executor runs the backward
    pass across all frames together.  The simulator's prediction (the worst of the
    orders it emulates) is at most 5 % below what TensorFlow's records hold at the
    step's peak, and at most 20 % above; the depth-first walk alone reads more than 10 %
    below (15.3 MiB against 18.6-20.3 measured in five processes).  With its copies
    chained in the depth-first order (op_order.chained_order) there is no wave: the step
    holds a tenth less, and the prediction, of that order alone, is within 5 % of it
    (15.92 MiB measured, 16.06 predicted, on Eigen)."""
    for onednn in (False, True):
        figures = _child(WAVE, onednn=onednn)
        measured, predicted = figures["measured"], figures["predicted"]
        assert figures["partitions"] == 1, figures
        assert predicted["depth first"] < 0.9 * measured, (onednn, figures)
        assert 0.95 * measured <= predicted["simulator"] <= 1.2 * measured, (onednn, figures)
        chained = figures["chained"]
        assert chained["measured"] < 0.9 * measured, (onednn, figures)
        assert abs(chained["predicted"] - chained["measured"]) <= 0.05 * chained["measured"], \
            (onednn, figures)


@pytest.mark.slow
def test_the_executor_emulation_numbers_and_folds_the_graph_as_tensorflow_does():
    """The emulated executor's inputs, checked against the graph TensorFlow ran
    (`output_partition_graphs`, the Eigen path, DeepSpeech as one partition): its node
    numbering puts tfmem's copies in TensorFlow's id order, and the ops it takes as
    folded into constants are exactly those of the partition TensorFlow did not run."""
    figures = _child(NUMBERING, onednn=False)
    assert figures["copies"] > 1000 and figures["in_id_order"], figures["copies"]
    assert figures["folded"] and figures["folded"] == figures["not_run"], figures
