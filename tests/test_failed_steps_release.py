"""Failing steps release what they took; successful steps release it too.

A step can fail in a late partition, after earlier partitions have left
session handles on the device, host buffers in the pool and uploads on the
prefetch thread.  The step must raise what plain ``Session.run`` raises and
give all of that back, so the next step starts from the same state.

Two levels of checking:

* in this process: the error type, the host buffer pool (nothing in use),
  and that the next good step still matches plain ``Session.run``;
* device memory, in a subprocess whose TensorFlow CPU allocator is the
  emulated accelerator (``TF_CPU_ALLOCATOR_USE_BFC``): only then does
  ``tf.config.experimental.get_memory_info('CPU:0')['current']`` count the
  bytes TensorFlow holds, and the setting must be made before the first
  session of the process exists.  Every scenario of that subprocess runs
  once (module fixture) and the tests below assert on its measurements.
"""

import _thread
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from conftest import ATOL, RTOL, assert_same_result, build_mlp, new_session, worker_results

tf1 = tf.compat.v1

MODES = ("all", "auto", "none")
CHECK_MESSAGE = "log of a non-positive scale"


class StepFailure(Exception):
    """Raised by the py_func of a late partition."""


# --------------------------------------------------------------------------
# graphs


def _failing_body(kind):
    def body(h, scale):
        if scale < 0:
            if kind == "keyboard":
                raise KeyboardInterrupt("stop from inside a step")
            if kind == "custom":
                raise StepFailure("bad scale")
            if kind == "interrupt":  # a real Ctrl-C: the main thread gets KeyboardInterrupt
                _thread.interrupt_main()
        return np.asarray(h * np.log(abs(scale) + 1.0), np.float32)
    return body


def build_failing(kind="check", size=32, chain=6):
    """x -> sin -> matmul -> chain -> FAILING OP -> tail -> out.

    `early`, `first` and the failing op's input `h` are read again by `out`.

    The failing op depends on the fed `scale` and sits in a late partition:
    check_numerics on log(scale) (kind "check"), or a py_func that raises
    (kinds "keyboard", "custom") or interrupts the main thread ("interrupt")
    when scale < 0.
    """
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [size, size], name="x")
        scale = tf1.placeholder(tf.float32, [], name="scale")
        w = tf1.Variable(np.eye(size, dtype=np.float32) * 0.5, name="w", use_resource=True)
        early = tf.sin(x, name="early")
        first = tf.tanh(tf.matmul(early, w), name="first")
        h = first
        for i in range(chain):
            h = tf.tanh(h * 0.9 + 0.1, name=f"h{i}")
        if kind == "check":
            failing = tf.debugging.check_numerics(h * tf.math.log(scale), CHECK_MESSAGE, name="failing")
        else:
            failing = tf1.py_func(_failing_body(kind), [h, scale], tf.float32, name="failing")
            failing.set_shape([size, size])
        # a matmul allocates its output from TF (an elementwise op could reuse
        # the py_func's numpy buffer, which TF's allocator does not count)
        tail = tf.matmul(failing, w, name="tail")
        for i in range(3):
            tail = tf.sin(tail, name=f"t{i}")
        out = tf.reduce_sum(tail * early + first + h, name="out")
        init = tf1.global_variables_initializer()
    rs = np.random.RandomState(0)
    xv = rs.standard_normal((size, size)).astype(np.float32)
    good = [{x: xv, scale: np.float32(2.0)}, {x: xv * 0.5, scale: np.float32(3.0)}]
    bad = {x: xv, scale: np.float32(-1.0)}
    return g, out, init, good, bad


def _settings(mode, prefetch, partition_size=2):
    kwargs = dict(partition_size=partition_size, swap=mode, prefetch=prefetch)
    if mode == "auto":
        kwargs["options"] = tfmem.Options(swap_min_bytes=0)
    return kwargs


def _failing_partition(plan):
    return next(p.index for p in plan.partitions if "failing" in p.ops)


def _check_failure_setup(plan, mode, prefetch):
    """The failure must find handles/buffers/uploads to release, or the test proves nothing."""
    fail = _failing_partition(plan)
    assert fail >= 3, "the failing op should sit in a late partition"
    assert fail < len(plan.partitions) - 1
    across = [t for t in plan.transfers if t.producer < fail < max(t.consumers)]
    assert across, "nothing produced before the failure is read after it"
    if mode == "none":
        assert all(t.kept for t in across)
    else:
        assert any(t.swapped for t in across), "no host buffer is held when the step fails"
    if mode != "none" and prefetch >= 3:
        assert any(s.uploaded and s.start <= fail < s.readers[0]
                   for t in across for s in t.spans), "no upload is under way at the failure"
    # keep this test apart from uploads of one tensor starting together (see test_no_growth_*)
    for t in plan.transfers:
        starts = [s.start for s in t.spans if s.uploaded]
        assert len(starts) == len(set(starts)), t


def _error_of(run):
    try:
        run()
    except BaseException as err:  # pylint: disable=broad-except
        return err
    raise AssertionError("the step did not fail")


# --------------------------------------------------------------------------
# in this process: error type, buffers, recovery


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_failed_step_raises_like_plain_and_releases_buffers(mode, prefetch, sessions):
    g, out, init, good, bad = build_failing("check")
    plain = sessions(g)
    tfs = tfmem.TFMemSession(sessions(g), **_settings(mode, prefetch))
    plain.run(init)
    tfs.run(init)
    plan = tfs.plan(out, feed_dict=good[0])
    _check_failure_setup(plan, mode, prefetch)
    pool = tfs.host_buffers

    assert_same_result(plain.run(out, feed_dict=good[0]), tfs.run(out, feed_dict=good[0]))
    allocations = pool.allocations
    expected = _error_of(lambda: plain.run(out, feed_dict=bad))
    assert isinstance(expected, tf.errors.InvalidArgumentError)
    for attempt in range(2):
        err = _error_of(lambda: tfs.run(out, feed_dict=bad))
        assert type(err) is type(expected), f"plain raised {expected!r}, tfmem raised {err!r}"
        assert CHECK_MESSAGE in str(err)
        assert pool.in_use_bytes == 0, f"attempt {attempt}: {pool.in_use_bytes} bytes of host buffers still in use"
        del err
        for feed in good:
            assert_same_result(plain.run(out, feed_dict=feed), tfs.run(out, feed_dict=feed))
            assert pool.in_use_bytes == 0
    assert pool.allocations == allocations, "failed steps lost buffers the pool had to replace"


@pytest.mark.parametrize("kind", ["keyboard", "custom"])
@pytest.mark.parametrize("mode, prefetch", [("all", 3), ("auto", 1), ("none", 0)])
def test_exception_from_py_func_releases_buffers(kind, mode, prefetch, sessions):
    g, out, init, good, bad = build_failing(kind)
    plain = sessions(g)
    tfs = tfmem.TFMemSession(sessions(g), **_settings(mode, prefetch))
    plain.run(init)
    tfs.run(init)
    _check_failure_setup(tfs.plan(out, feed_dict=good[0]), mode, prefetch)
    assert_same_result(plain.run(out, feed_dict=good[0]), tfs.run(out, feed_dict=good[0]))

    expected = _error_of(lambda: plain.run(out, feed_dict=bad))
    err = _error_of(lambda: tfs.run(out, feed_dict=bad))
    assert type(err) is type(expected), f"plain raised {expected!r}, tfmem raised {err!r}"
    assert ("KeyboardInterrupt" if kind == "keyboard" else "StepFailure") in str(err)
    assert tfs.host_buffers.in_use_bytes == 0
    del err, expected
    for feed in good:
        assert_same_result(plain.run(out, feed_dict=feed), tfs.run(out, feed_dict=feed))
    assert tfs.host_buffers.in_use_bytes == 0


def test_bad_feed_shape_raises_like_plain(sessions):
    """A request mistake raises what Session.run raises and leaves nothing behind."""
    g, out, init, good, bad = build_failing("check")
    x = g.get_tensor_by_name("x:0")
    plain = sessions(g)
    tfs = tfmem.TFMemSession(sessions(g), **_settings("all", 1))
    plain.run(init)
    tfs.run(init)
    tfs.run(out, feed_dict=good[0])
    wrong = dict(good[0])
    wrong[x] = np.ones((3, 3), np.float32)
    expected = _error_of(lambda: plain.run(out, feed_dict=wrong))
    err = _error_of(lambda: tfs.run(out, feed_dict=wrong))
    assert type(err) is type(expected)
    assert tfs.host_buffers.in_use_bytes == 0
    assert_same_result(plain.run(out, feed_dict=good[1]), tfs.run(out, feed_dict=good[1]))


# --------------------------------------------------------------------------
# device memory, measured in a subprocess with the emulated accelerator


def _memory():
    return int(tf.config.experimental.get_memory_info("CPU:0")["current"])


def _scenario_failure(kind, mode, prefetch, attempts=2):
    g, out, init, good, bad = build_failing(kind)
    plain = new_session(g)
    # interrupts: partition_size 3 puts `h` (read again at the end) beside the py_func
    tfs = tfmem.TFMemSession(new_session(g), **_settings(mode, prefetch, 3 if kind == "interrupt" else 2))
    plain.run(init)
    tfs.run(init)
    plan = tfs.plan(out, feed_dict=good[0])
    _check_failure_setup(plan, mode, prefetch)
    failing = plan.partitions[_failing_partition(plan)]
    # outputs of the failing partition kept on the device in memory TF allocated
    # (not the py_func's numpy buffer, not a variable's buffer)
    fresh_handles = [t for t in failing.outputs if plan.transfer(t).kept
                     and g.get_tensor_by_name(t).op.type not in ("PyFunc", "ReadVariableOp")]
    expected = [plain.run(out, feed_dict=feed) for feed in good]
    plain_error = type(_error_of(lambda: plain.run(out, feed_dict=bad))).__name__
    for _ in range(2):  # warm up: constants cache their values on first run
        for feed in good:
            tfs.run(out, feed_dict=feed)
    before = _memory()
    errors, after_failure, in_use = [], [], []
    for _ in range(attempts):
        errors.append(type(_error_of(lambda: tfs.run(out, feed_dict=bad))).__name__)
        after_failure.append(_memory())
        in_use.append(tfs.host_buffers.in_use_bytes)
    got = [tfs.run(out, feed_dict=feed) for feed in good]
    matches = all(np.allclose(e, r, rtol=RTOL, atol=ATOL) for e, r in zip(expected, got))
    after_recovery = _memory()
    tfs.close()
    plain.close()
    return dict(plain_error=plain_error, errors=errors, before=before, after_failure=after_failure,
                in_use=in_use, matches=bool(matches), after_recovery=after_recovery,
                fresh_handles=fresh_handles)


def _build_reuse(size=64):
    """Each tensor read in two consecutive partitions, and once more far away."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [size, size], name="x")
        a = tf.tanh(x, name="a")
        b = tf.sin(a, name="b")
        c = tf.add(b, a, name="c")
        d = tf.cos(c, name="d")
        e = tf.multiply(d, c, name="e")
        f = tf.exp(-e, name="f")
        out = tf.reduce_sum(f + a, name="out")
    return g, out, {x: np.random.RandomState(1).standard_normal((size, size)).astype(np.float32)}


def _scenario_steady(graph_name, mode, prefetch):
    if graph_name == "mlp":
        model = build_mlp("adam")
        g, fetches, init = model.graph, [model.train, model.loss], model.init
        feeds = [model.data[i % len(model.data)] for i in range(6)]
    else:
        g, out, feed = _build_reuse()
        fetches, init, feeds = out, None, [feed] * 6
    tfs = tfmem.TFMemSession(new_session(g), partition_size=3 if graph_name == "mlp" else 1,
                             swap=mode, prefetch=prefetch,
                             # its device peak is read every step
                             options=tfmem.Options(swap_min_bytes=0, measure="every"))
    if init is not None:
        tfs.run(init)
    plan = tfs.plan(fetches, feed_dict=feeds[0])
    shared_starts = sum(len(starts) - len(set(starts)) for starts in
                        ([s.start for s in t.spans if s.uploaded] for t in plan.transfers))
    memory, peaks = [], []
    for feed in feeds:
        tfs.run(fetches, feed_dict=feed)
        memory.append(_memory())
        peaks.append(tfs.last_step.device_peak_bytes)
    tfs.close()
    return dict(memory=memory, peaks=peaks, swapped=sum(t.swapped for t in plan.transfers),
                shared_starts=shared_starts)


_probed = []


def _probe():
    _probed.append(int(tf.config.experimental.get_memory_info("CPU:0")["current"]))
    return np.float32(0)


def _scenario_freed(mode):
    """A 4 MiB tensor swapped out after partition 0; what does partition 1 see on the device?"""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [1024, 1024], name="x")
        big = tf.multiply(x, 2.0, name="big")
        with tf.control_dependencies([big]):
            probe = tf1.numpy_function(_probe, [], tf.float32, name="probe")
        probe.set_shape([])
        with tf.control_dependencies([probe]):
            total = tf.reduce_sum(big, name="total")
        out = tf.add(probe, total, name="out")
    feed = {x: np.ones((1024, 1024), np.float32)}
    tfs = tfmem.TFMemSession(new_session(g), partition_size=1, swap=mode, prefetch=0)
    plan = tfs.plan(out, feed_dict=feed)
    order = {op: p.index for p in plan.partitions for op in p.ops}
    result = []
    for _ in range(3):
        del _probed[:]
        value = tfs.run(out, feed_dict=feed)
        result.append(_probed[0])
    tfs.close()
    return dict(probed=result, value=float(value), big_nbytes=4 << 20,
                big_partition=order["big"], probe_partition=order["probe"],
                swapped=plan.transfer("big:0").swapped)


INTERRUPTS = 4

FAILURE_CASES = ([("check", mode, prefetch) for mode in MODES for prefetch in (0, 1, 3)]
                 + [("custom", mode, prefetch) for mode, prefetch in (("all", 3), ("auto", 1), ("none", 0))])
INTERRUPT_CASES = [("all", 2), ("auto", 1), ("none", 0)]
STEADY_CASES = ([("reuse", mode, prefetch) for mode in MODES for prefetch in (0, 1, 3)]
                + [("mlp", "all", prefetch) for prefetch in (0, 1, 3)] + [("mlp", "auto", 1), ("mlp", "none", 1)])

SCENARIOS = (
    [("failure",) + case for case in FAILURE_CASES]
    + [("failure", "interrupt", mode, prefetch, INTERRUPTS) for mode, prefetch in INTERRUPT_CASES]
    + [("steady",) + case for case in STEADY_CASES]
    + [("freed", mode) for mode in ("all", "none")]
)


def _key(scenario):
    return "/".join(map(str, scenario))


def _bfc_worker():
    """Entry point of the subprocess: run every scenario, print one JSON line."""
    from tfmem.run.placement import accelerator  # pylint: disable=import-outside-toplevel
    assert accelerator.emulated_memory_mib() is not None
    # Python's Ctrl-C handler, which a worker of a pytest started in the background by a
    # shell without job control would not have (SIGINT ignored: an interrupt does nothing)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    results = {}
    for scenario in SCENARIOS:
        name, args = scenario[0], scenario[1:]
        try:
            results[_key(scenario)] = globals()["_scenario_" + name](*args)
        except BaseException as err:  # pylint: disable=broad-except
            results[_key(scenario)] = {"crashed": f"{type(err).__name__}: {err}"}
    print("TFMEM-RESULTS " + json.dumps(results))


@pytest.fixture(scope="module", autouse=True)
def _worker():
    """Start the measuring subprocess with the module's first test, so it runs beside them."""
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPU_BFC_MEM_LIMIT_IN_MB="1024",
               TF_CPP_MIN_LOG_LEVEL="2")
    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys; sys.path.insert(0, {here!r}); "
            "import test_failed_steps_release; test_failed_steps_release._bfc_worker()")
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    yield proc
    if proc.poll() is None:  # no test asked for the measurements
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def measured(_worker):
    return worker_results(_worker, timeout=300)


def _result(measured, *scenario):
    result = measured[_key(scenario)]
    assert "crashed" not in result, result["crashed"]
    return result


@pytest.mark.parametrize("kind, mode, prefetch", FAILURE_CASES)
@pytest.mark.slow
def test_failed_step_frees_device_memory(measured, kind, mode, prefetch):
    r = _result(measured, "failure", kind, mode, prefetch)
    assert r["errors"] == [r["plain_error"]] * 2
    assert r["in_use"] == [0, 0]
    assert r["after_failure"] == [r["before"]] * 2, (
        f"TF allocator held {r['before']} bytes after a good step, "
        f"{r['after_failure']} after each failed step")
    assert r["matches"]
    assert r["after_recovery"] == r["before"]


@pytest.mark.parametrize("mode, prefetch", INTERRUPT_CASES)
@pytest.mark.slow
def test_keyboard_interrupt_frees_everything(measured, mode, prefetch):
    """A real Ctrl-C (SIGINT handled in the main thread) in a late partition.

    Where the interrupt lands is up to the interpreter: inside the
    partition's Session call, or just after it returned its handles.
    Either way the step must give back everything it took.
    """
    r = _result(measured, "failure", "interrupt", mode, prefetch, INTERRUPTS)
    if mode == "none":  # something the interrupted partition hands over, to be released
        assert r["fresh_handles"], "the interrupted partition keeps nothing on the device"
    assert r["plain_error"] == "KeyboardInterrupt"
    assert r["errors"] == ["KeyboardInterrupt"] * INTERRUPTS
    assert r["in_use"] == [0] * INTERRUPTS
    assert r["after_failure"] == [r["before"]] * INTERRUPTS, (
        f"TF allocator held {r['before']} bytes after a good step, "
        f"{r['after_failure']} after each interrupted step")
    assert r["matches"]
    assert r["after_recovery"] == r["before"]


@pytest.mark.parametrize("graph, mode, prefetch", STEADY_CASES)
@pytest.mark.slow
def test_no_growth_over_good_steps(measured, graph, mode, prefetch):
    """Successful steps give back every handle and upload: TF memory stays flat.

    Both graphs read tensors in consecutive partitions, so with prefetch >= 1
    and swap="all" one tensor has several uploads starting in one partition.
    """
    r = _result(measured, "steady", graph, mode, prefetch)
    if mode != "none":
        assert r["swapped"] > 0
    memory = r["memory"]
    assert memory[1:] == [memory[1]] * (len(memory) - 1), (
        f"TF allocator current bytes after each step: {memory} "
        f"({r['shared_starts']} uploads share a start partition with another of the same tensor)")
    assert all(isinstance(p, int) and p > 0 for p in r["peaks"]), r["peaks"]


@pytest.mark.slow
def test_swapped_tensor_leaves_the_device_after_its_partition(measured):
    """After partition 0 swaps `big` out, partition 1 runs without it on the device."""
    kept = _result(measured, "freed", "none")
    swapped = _result(measured, "freed", "all")
    assert swapped["swapped"] and not kept["swapped"]
    assert swapped["probe_partition"] == swapped["big_partition"] + 1
    assert swapped["value"] == kept["value"] == 2.0 * (1 << 20)
    big = swapped["big_nbytes"]
    assert all(p >= big for p in kept["probed"]), kept  # the probe sees a kept tensor
    assert all(p < big for p in swapped["probed"]), (
        f"{swapped['probed']} bytes on the device while partition {swapped['probe_partition']} "
        f"runs, though the {big}-byte output of partition {swapped['big_partition']} was swapped out")
