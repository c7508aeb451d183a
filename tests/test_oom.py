"""Out of memory inside a partition raises DeviceMemoryError, frees the step, and says what fits.

Two levels, as in test_failed_steps_release:

* in this process, a py_func raising MemoryError("OOM ...") stands in for an
  allocation failure (TensorFlow maps MemoryError to ResourceExhaustedError):
  quick checks of the error's type, message and attributes, of released host
  buffers and of the next step;
* a real out-of-memory, in a subprocess whose TensorFlow CPU allocator is
  capped (the emulated accelerator): TensorFlow's allocator figures before and
  after the failed step, and the suggested partition_size run under the same
  cap with plain TensorFlow's results.  TensorFlow's allocator waits about 10 s
  before it reports an out-of-memory, so the subprocess fails once only.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from conftest import ATOL, RTOL, assert_same_result, new_session, worker_results

tf1 = tf.compat.v1

MIB = 1 << 20
CAP_MIB = 12  # plain TensorFlow's peak for BATCH is about 21 MiB
BATCH, SMALL = 1024, 64
WIDTH, LAYERS = 256, 8


# --------------------------------------------------------------------------
# in this process: a py_func that reports an out-of-memory


def _oom_body(message):
    def body(h, flag):
        if flag:
            raise MemoryError(message)
        return h
    return body


def build_reporting(message="OOM when allocating tensor with shape[64,64]", size=64):
    """x -> chain -> PY_FUNC (raises MemoryError(message) when `flag` is fed True) -> tail."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, size], name="x")
        flag = tf1.placeholder_with_default(False, [], name="flag")
        early = tf.sin(x, name="early")
        h = early
        for i in range(6):
            h = tf.tanh(h * 0.9 + 0.1, name=f"h{i}")
        failing = tf1.numpy_function(_oom_body(message), [h, flag], tf.float32, name="failing")
        failing.set_shape(h.shape)
        tail = tf.cos(failing, name="tail")
        out = tf.reduce_sum(tail * early, name="out")
    feed = {x: np.random.RandomState(0).standard_normal((32, size)).astype(np.float32)}
    return g, x, flag, out, feed


def test_out_of_memory_in_a_partition_raises_device_memory_error(sessions):
    g, _, flag, out, feed = build_reporting()
    plain = sessions(g)
    tfs = tfmem.TFMemSession(sessions(g), partition_size=3, swap="all", prefetch=1)
    plan = tfs.plan(out, feed_dict=feed)
    failing = next(p for p in plan.partitions if "failing" in p.ops)
    assert 0 < failing.index < len(plan.partitions) - 1
    assert any(t.swapped and t.producer < failing.index < max(t.consumers)
               for t in plan.transfers), "no host buffer is held when the partition fails"
    expected = plain.run(out, feed_dict=feed)
    assert_same_result(expected, tfs.run(out, feed_dict=feed))

    bad = {**feed, flag: True}
    with pytest.raises(tf.errors.ResourceExhaustedError) as plain_error:
        plain.run(out, feed_dict=bad)
    with pytest.raises(tf.errors.ResourceExhaustedError) as caught:  # users' except still works
        tfs.run(out, feed_dict=bad)
    err = caught.value
    assert isinstance(err, tfmem.DeviceMemoryError) and isinstance(err, tfmem.TFMemError)
    assert not isinstance(plain_error.value, tfmem.TFMemError)
    assert err.partition == failing.index
    assert err.ops == len(failing.ops)
    message = str(err)
    assert f"partition {failing.index} of {len(plan.partitions)} ({len(failing.ops)} ops" in message
    assert "OOM when allocating" in message  # TensorFlow's reason
    # the largest tensors: the partition's [32, 64] float tensors first, by user names
    sizes = [n for _, n in err.largest]
    assert sizes[0] == 32 * 64 * 4 and sizes == sorted(sizes, reverse=True), err.largest
    for name, _ in err.largest:
        assert f"'{name}'" in message and not name.startswith("tfmem/")  # the user's names
    # a smaller plan the simulator predicts to fit, and it runs
    assert err.partition_size is not None and err.swap == "all"
    assert f"partition_size={err.partition_size}" in message
    suggested = dict(partition_size=err.partition_size, swap=err.swap)
    assert isinstance(err.__cause__, tf.errors.ResourceExhaustedError)
    assert tfs.host_buffers.in_use_bytes == 0
    del err, caught
    assert_same_result(expected, tfs.run(out, feed_dict=feed))
    assert_same_result(expected, tfmem.TFMemSession(tfs.session, **suggested).run(out, feed))


def test_other_exhausted_resources_are_not_reported_as_device_memory(sessions):
    """A ResourceExhaustedError that is not an allocation failure passes through as it is."""
    g, _, flag, out, feed = build_reporting(message="quota of requests exceeded")
    plain = sessions(g)
    tfs = tfmem.TFMemSession(sessions(g), partition_size=3, swap="all")
    bad = {**feed, flag: True}
    with pytest.raises(tf.errors.ResourceExhaustedError) as expected:
        plain.run(out, feed_dict=bad)
    with pytest.raises(tf.errors.ResourceExhaustedError) as caught:
        tfs.run(out, feed_dict=bad)
    assert type(caught.value) is type(expected.value)
    assert "quota of requests exceeded" in str(caught.value)
    assert tfs.host_buffers.in_use_bytes == 0


def test_a_partition_that_failed_below_every_prediction_still_gets_the_most_cautious_plan(
        sessions):
    """A partition can fail under its own prediction (another thread's uploads, the
    allocator's chunks); then no plan is predicted to need less, and the suggestion is
    the plan fitted to the smallest budget that fits, not none at all."""
    from tfmem.memory import oom  # pylint: disable=import-outside-toplevel
    from tfmem.memory.sizing import Sizing  # pylint: disable=import-outside-toplevel
    g, _, _, out, feed = build_reporting()
    tfs = tfmem.TFMemSession(sessions(g), partition_size=3, swap="all")
    plan = tfs.plan(out, feed_dict=feed)
    shapes = {tensor.name: value.shape for tensor, value in feed.items()}
    capacity = 64 * MIB
    sizing = Sizing.of(g, plan.view, shapes)
    found = oom.suggest(plan, sizing, capacity, failed_peak=1)
    assert found is not None
    size, target, peak, _ = found
    assert target < capacity and peak <= target  # halved until nothing smaller fits
    ample = oom.suggest(plan, sizing, capacity, failed_peak=capacity)
    assert ample[1] == capacity and ample[0] >= size  # the first fit when it is under
    assert_same_result(tfs.run(out, feed_dict=feed),
                       tfmem.TFMemSession(tfs.session, partition_size=size).run(out, feed))


def test_device_memory_error_pickles_with_its_figures():
    err = tfmem.DeviceMemoryError("partition 2 ran out", partition=2, ops=7,
                                  largest=[("a:0", 1024)], partition_size=3, budget=MIB,
                                  swap="auto")
    import pickle  # pylint: disable=import-outside-toplevel
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is tfmem.DeviceMemoryError
    assert (copy.partition, copy.ops, copy.largest, copy.partition_size, copy.budget,
            copy.swap) == (2, 7, (("a:0", 1024),), 3, MIB, "auto")
    assert str(copy) == "partition 2 ran out"


# --------------------------------------------------------------------------
# a real out-of-memory under the emulated accelerator


def build_model(layers=LAYERS, width=WIDTH, seed=0):
    """An MLP's loss and gradient norm (no updates): activations live until the backward pass."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, width], name="x")
        h, weights = x, []
        for i in range(layers):
            w = tf1.get_variable(f"w{i}", [width, width],
                                 initializer=tf1.glorot_uniform_initializer(seed=seed + i))
            weights.append(w)
            h = tf.nn.relu(tf.matmul(h, w))
            h = tf.sin(h) * 0.5 + h
        loss = tf.reduce_mean(tf.square(h), name="loss")
        norm = tf.linalg.global_norm(tf.gradients(loss, weights), name="norm")
        init = tf1.global_variables_initializer()
    return g, x, [loss, norm], init


def _feed(x, batch):
    return {x: np.random.RandomState(batch).standard_normal((batch, WIDTH)).astype(np.float32)}


def _memory():
    return int(tf.config.experimental.get_memory_info("CPU:0")["current"])


def _capped_worker():
    """Subprocess entry: fail once under the cap, recover, run the suggestion; print JSON."""
    g, x, fetches, init = build_model()
    sess = new_session(g)
    sess.run(init)
    small_plain = sess.run(fetches, feed_dict=_feed(x, SMALL))
    tfs = tfmem.TFMemSession(sess, partition_size=30, swap="none")
    plan = tfs.plan(fetches, feed_dict=_feed(x, BATCH))
    small_first = tfs.run(fetches, feed_dict=_feed(x, SMALL))  # warm up: constants, callables
    before = _memory()
    result = dict(partitions=len(plan.partitions), before=before,
                  small_plain=np.asarray(small_plain).tolist(),
                  small_first=np.asarray(small_first).tolist())
    try:
        tfs.run(fetches, feed_dict=_feed(x, BATCH))
        result["error"] = None
    except tf.errors.ResourceExhaustedError as err:
        result.update(error=type(err).__name__, message=str(err),
                      is_tfmem=isinstance(err, tfmem.TFMemError), partition=err.partition,
                      ops=err.ops, largest=err.largest, partition_size=err.partition_size,
                      budget=err.budget, swap=err.swap, cause=type(err.__cause__).__name__)
        suggested = dict(partition_size=err.partition_size, swap=err.swap)
        del err
    result["after"] = _memory()
    result["in_use"] = tfs.host_buffers.in_use_bytes
    result["small_after"] = np.asarray(tfs.run(fetches, feed_dict=_feed(x, SMALL))).tolist()
    result["after_small"] = _memory()
    if result["error"]:
        fitted = tfmem.TFMemSession(sess, **suggested)
        result["big"] = [np.asarray(fitted.run(fetches, feed_dict=_feed(x, BATCH))).tolist()
                         for _ in range(2)]
        result["big_peak"] = fitted.last_step.device_peak_bytes
        trace = fitted.simulate(fetches, feed_dict=_feed(x, BATCH))
        result["big_predicted"] = trace.peak_device
        result["big_predicted_chunks"] = trace.peak_device_chunks
    print("TFMEM-RESULTS " + json.dumps(result))


@pytest.fixture(scope="module", autouse=True)
def _worker():
    """Start the capped subprocess with the module's first test, so it runs beside them."""
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true",
               TF_CPU_BFC_MEM_LIMIT_IN_MB=str(CAP_MIB), TF_CPP_MIN_LOG_LEVEL="2",
               TF_ENABLE_ONEDNN_OPTS="0")  # oneDNN kernels can crash on a failed allocation
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import test_oom; test_oom._capped_worker()"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def capped(_worker):
    return worker_results(_worker, timeout=240)


@pytest.fixture(scope="module")
def expected():
    """Plain TensorFlow's results, uncapped, in this process."""
    g, x, fetches, init = build_model()
    sess = new_session(g)
    try:
        sess.run(init)
        return {batch: sess.run(fetches, feed_dict=_feed(x, batch)) for batch in (SMALL, BATCH)}
    finally:
        sess.close()


@pytest.mark.slow
def test_capped_out_of_memory_names_the_partition_and_its_tensors(capped):
    assert capped["partitions"] > 2
    assert capped["error"] == "DeviceMemoryError", capped.get("message")
    assert capped["is_tfmem"] and capped["cause"] == "ResourceExhaustedError"
    message = capped["message"]
    assert f"partition {capped['partition']} of {capped['partitions']} ({capped['ops']} ops" in message
    assert 0 < capped["ops"] <= 30
    assert "OOM when allocating" in message
    assert f"on a device of {CAP_MIB:.1f} MiB" in message
    # the largest tensors are activations of the batch: [BATCH, WIDTH] floats
    assert [n for _, n in capped["largest"]] == [BATCH * WIDTH * 4] * 3, capped["largest"]
    for name, _ in capped["largest"]:
        assert f"'{name}' 1.0 MiB" in message
        assert not name.startswith("tfmem/")  # the user's names, not the copies'


@pytest.mark.slow
def test_capped_out_of_memory_releases_the_step(capped, expected):
    assert capped["after"] == capped["before"], (
        f"TF allocator held {capped['before']} bytes before the failed step, {capped['after']} after")
    assert capped["in_use"] == 0
    assert capped["after_small"] == capped["before"]
    for key in ("small_plain", "small_first", "small_after"):
        np.testing.assert_allclose(capped[key], expected[SMALL], rtol=RTOL, atol=ATOL, err_msg=key)


@pytest.mark.slow
def test_capped_suggestion_fits_under_the_same_cap(capped, expected):
    assert capped["partition_size"] is not None, capped["message"]
    assert f"partition_size={capped['partition_size']}" in capped["message"]
    assert capped["budget"] == CAP_MIB * MIB
    assert f"device_memory_budget='{CAP_MIB}MiB'" in capped["message"]
    for got in capped["big"]:
        np.testing.assert_allclose(got, expected[BATCH], rtol=RTOL, atol=ATOL)
    # The run under the cap is within the cap by construction; what could be wrong is the
    # prediction the suggestion rests on.  TensorFlow's figure counts BFC chunks, and which
    # chunk a request gets depends on the allocator's history in the process (this one ran
    # out of memory before), so the measured peak is held to the simulator's chunk figure
    # with its worst-step band (test_simulate, Eigen: 15 %): a loaded CI machine can read
    # 9.75 MiB against 8.00 requested and 9.00 in chunks; quiet runs read 8.00.
    predicted = capped["big_predicted"]
    chunks, measured = capped["big_predicted_chunks"], capped["big_peak"]
    assert predicted <= CAP_MIB * MIB
    assert 0 < measured <= 1.15 * max(predicted, chunks), (
        f"measured {measured / MIB:.2f} MiB, predicted {predicted / MIB:.2f} MiB requested, "
        f"{chunks / MIB:.2f} MiB in chunks")
