"""`tfmem run` and `python -m tfmem.autowrap` on unmodified programs.

tests/programs/train_tf1.py is a TF1-style training program that knows
nothing about tfmem (queue runners with a coordinator and a Saver, a
MonitoredTrainingSession with hooks restarted from its checkpoint, a
Supervisor).  Each mode runs twice in fresh processes, plainly and through
`tfmem run`, and the printed losses must agree; the summary must show that
the steps ran in several partitions.
"""

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from conftest import session_config

tf1 = tf.compat.v1

PROGRAM = os.path.join(os.path.dirname(__file__), "programs", "train_tf1.py")
# one session per route a program may take to TensorFlow's session classes
ROUTES_PROGRAM = os.path.join(os.path.dirname(__file__), "programs", "session_routes.py")
TIMEOUT = 300


def _env(**extra):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")  # this process's kernel path (conftest)
    env.pop("TFMEM", None)
    env.update(extra)
    return env


def _run(command, env=None):
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT,
                          env=env or _env(), check=False)
    assert done.returncode == 0, f"{command} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done


def _losses(stdout):
    lines = [line.split() for line in stdout.splitlines() if line.startswith("loss ")]
    return [key for _, key, _ in lines], np.array([float(value) for _, _, value in lines])


def _sessions(stdout):
    return [line for line in stdout.splitlines() if line.startswith("sessions ")]


def _first_mode(stdout):
    """The output up to the end of the first mode the program ran."""
    lines = stdout.splitlines(keepends=True)
    end = next(i for i, line in enumerate(lines) if line.startswith("sessions "))
    return "".join(lines[:end + 1])


def _same_program_output(plain, wrapped):
    keys, expected = _losses(plain)
    got_keys, got = _losses(wrapped)
    assert keys and got_keys == keys
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert _sessions(wrapped) == _sessions(plain)


MODES = "queue,monitored,supervisor"


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """The program's output run plainly, every mode in one process."""
    logdir = tmp_path_factory.mktemp("plain")
    return _run([sys.executable, PROGRAM, "--mode", MODES, "--logdir", str(logdir)])


@pytest.mark.slow
def test_tfmem_run_gives_the_plain_losses(tmp_path, plain_run):
    summary = tmp_path / "summary.json"
    wrapped = _run([sys.executable, "-m", "tfmem", "run", "--partition-size", "6",
                    "--summary-json", str(summary),
                    PROGRAM, "--mode", MODES, "--logdir", str(tmp_path / "tfmem")])
    _same_program_output(plain_run.stdout, wrapped.stdout)
    assert len(_sessions(wrapped.stdout)) == 3
    report = json.loads(summary.read_text())
    assert report["settings"] == "partition_size=6"
    sessions = [s for s in report["sessions"] if s["steps"]]
    assert len(sessions) == 4  # queue 1, monitored 2 (the restart), supervisor 1
    for totals in sessions:
        assert totals["most_partitions"] > 1 and totals["plain_runs"] == 0
        assert totals["predicted_peak_bytes"] > 0 and totals["predicted_plain_peak_bytes"] > 0
    assert "tfmem: session 4:" in wrapped.stderr and "partitions run" in wrapped.stderr
    # the restarted monitored program continued from the first one's checkpoint
    restarted = tf.train.latest_checkpoint(str(tmp_path / "tfmem" / "monitored"))
    assert restarted.endswith("model.ckpt-8")


def test_environment_variable_with_an_emulated_accelerator(tmp_path, plain_run):
    """TFMEM for other launchers; on an emulated accelerator the peak is measured."""
    summary = tmp_path / "summary.json"
    wrapped = _run([sys.executable, "-m", "tfmem.autowrap", PROGRAM, "--mode", "queue",
                    "--logdir", str(tmp_path / "t")],
                   _env(TFMEM=f"partition_size=6,swap=all,device_memory=512,"
                              f"summary_json={summary}"))
    _same_program_output(_first_mode(plain_run.stdout), wrapped.stdout)
    for totals in json.loads(summary.read_text())["sessions"]:
        assert totals["device_peak_bytes"] > 0
        assert totals["swapped_out_bytes"] > 0 and totals["swapped_in_bytes"] > 0


def _route_losses(stdout):
    """{route: [losses]} from session_routes.py's `loss <route> <step> <value>` lines."""
    losses = {}
    for line in stdout.splitlines():
        if line.startswith("loss "):
            _, route, _, value = line.split()
            losses.setdefault(route, []).append(float(value))
    return losses


@pytest.mark.slow
def test_every_route_to_the_session_classes_is_wrapped(tmp_path):
    """`import tensorflow.compat.v1 as tf` (a module object of its own), `from
    tensorflow.compat.v1 import Session`, `tf.compat.v1.Session`, the defining module,
    an InteractiveSession run by `eval`, and model code in an imported module."""
    plain = _run([sys.executable, ROUTES_PROGRAM])
    summary = tmp_path / "summary.json"
    wrapped = _run([sys.executable, "-m", "tfmem", "run", "--partition-size", "3",
                    "--summary-json", str(summary), ROUTES_PROGRAM])
    expected, got = _route_losses(plain.stdout), _route_losses(wrapped.stdout)
    assert len(expected) == 6 and sorted(got) == sorted(expected)
    for route, losses in expected.items():
        np.testing.assert_allclose(got[route], losses, rtol=1e-5, err_msg=route)
    sessions = json.loads(summary.read_text())["sessions"]
    assert len(sessions) == len(expected)  # one wrapped session per route
    for totals in sessions:
        assert totals["steps"] >= 3 and totals["most_partitions"] > 1
        assert totals["plain_runs"] == 0
    assert "tfmem: WARNING" not in wrapped.stderr


def test_a_run_that_wraps_nothing_says_why(tmp_path):
    script = tmp_path / "eager.py"
    script.write_text("import tensorflow as tf\nprint('sum', float(tf.reduce_sum(tf.ones([3]))))\n")
    done = _run([sys.executable, "-m", "tfmem.autowrap", str(script)], _env(TFMEM="partition_size=3"))
    assert "sum 3.0" in done.stdout
    assert "tfmem: WARNING: nothing ran through tfmem" in done.stderr
    assert "no tf.compat.v1.Session" in done.stderr and "tfmem.function" in done.stderr


def test_bad_settings_are_refused_before_the_program_runs(tmp_path):
    marker = tmp_path / "ran"
    script = tmp_path / "script.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    bad_env = subprocess.run([sys.executable, "-m", "tfmem.autowrap", str(script)],
                             capture_output=True, text=True, timeout=TIMEOUT,
                             env=_env(TFMEM="partition_sise=5"), check=False)
    assert bad_env.returncode == 2 and "partition_sise" in bad_env.stderr
    bad_cli = subprocess.run([sys.executable, "-m", "tfmem", "run", "--budget", "lots",
                              str(script)], capture_output=True, text=True, timeout=TIMEOUT,
                             env=_env(), check=False)
    assert bad_cli.returncode == 2 and "lots" in bad_cli.stdout + bad_cli.stderr
    assert not marker.exists()


def _session_methods():
    from tensorflow.python.client import session as tf_session  # pylint: disable=import-outside-toplevel
    return {(cls.__name__, name): cls.__dict__.get(name)
            for cls in (tf_session.BaseSession, tf_session.Session, tf_session.InteractiveSession)
            for name in ("__init__", "run", "make_callable", "close")}


def test_import_tfmem_patches_nothing_and_uninstall_restores_everything():
    from tensorflow.python.client import session as tf_session  # pylint: disable=import-outside-toplevel
    before = _session_methods()
    from tfmem import autowrap  # pylint: disable=import-outside-toplevel
    assert tf1.Session is tf_session.Session
    assert tf1.InteractiveSession is tf_session.InteractiveSession
    assert _session_methods() == before
    with autowrap.install(partition_size=3):
        assert _session_methods() != before
    assert _session_methods() == before


def _threaded_program(graph, x, out, bump, counter, init, feeds):
    """Run `out` from 4 threads at once (with a counter bumped per run); the
    results in feed order and the final count."""
    sess = tf1.Session(graph=graph, config=session_config())
    sess.run(init)
    results = [None] * len(feeds)
    barrier = threading.Barrier(4)
    errors = []

    def work(index):
        try:
            barrier.wait()
            for i in range(index, len(feeds), 4):
                results[i] = sess.run([out, bump], {x: feeds[i]})[0]
        except BaseException as err:  # pylint: disable=broad-except
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    count = sess.run(counter)
    routed = getattr(sess, "tfmem", None)
    sess.close()
    return results, count, routed


def test_installed_sessions_from_many_threads():
    rs = np.random.RandomState(0)
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 8], name="x")
        w = tf1.Variable(rs.standard_normal((8, 8)).astype(np.float32), name="w")
        counter = tf1.Variable(0, dtype=tf.int64, name="counter")
        bump = counter.assign_add(1)
        h = x
        for i in range(5):
            h = tf.sin(tf.matmul(h, w) * 0.3, name=f"h{i}")
        out = tf.reduce_sum(h, axis=1)
        init = tf1.global_variables_initializer()
    feeds = [rs.standard_normal((3, 8)).astype(np.float32) for _ in range(24)]
    expected, expected_count, plain_routed = _threaded_program(g, x, out, bump, counter, init, feeds)
    from tfmem import autowrap  # pylint: disable=import-outside-toplevel
    with autowrap.install(partition_size=3) as installation:
        got, count, routed = _threaded_program(g, x, out, bump, counter, init, feeds)
    assert plain_routed is None and isinstance(routed, tfmem.TFMemSession)
    assert tf1.Session is not type(routed)  # uninstalled
    assert count == expected_count == len(feeds)
    for e, r in zip(expected, got):
        np.testing.assert_allclose(r, e, rtol=1e-5)
    totals = installation.recorder.totals()[0]
    assert totals.steps == len(feeds) + 2 and totals.most_partitions > 1


def test_installed_interactive_session_and_make_callable():
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [4], name="x")
        y = x
        for _ in range(6):
            y = tf.cos(y) * 1.5
    value = np.arange(4, dtype=np.float32)
    with tf1.Session(graph=g) as plain:
        expected = plain.run(y, {x: value})
    from tfmem import autowrap  # pylint: disable=import-outside-toplevel
    with autowrap.install(partition_size=2):
        sess = tf1.InteractiveSession(graph=g, config=session_config())
        try:
            assert isinstance(sess, tf1.InteractiveSession)
            assert tf1.get_default_session() is sess
            np.testing.assert_allclose(y.eval({x: value}), expected, rtol=1e-6)
            assert sess.tfmem.last_step.partitions > 1
            np.testing.assert_allclose(sess.make_callable(y, [x])(value), expected, rtol=1e-6)
        finally:
            sess.close()
    assert tf1.get_default_session() is None


def test_unplannable_request_runs_plainly_and_is_counted():
    """A state op with an input (here a control input) cannot be planned; under
    autowrap the plain session runs that request, and the summary says so."""
    g = tf.Graph()
    with g.as_default():
        counter = tf1.Variable(0, use_resource=True, name="counter")
        with tf.control_dependencies([counter.assign_add(1).op]):
            handle = tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[], shared_name="v")
        # Two runs: the assignment's control input reads `counter`, which must be
        # initialised first (one run would race the two, in plain TensorFlow too).
        init = [tf1.global_variables_initializer(),
                tf.raw_ops.AssignVariableOp(resource=handle, value=2.0)]
        out = tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.float32) * 3.0
    with tf1.Session(graph=g) as plain:
        for op in init:
            plain.run(op)
        expected = plain.run(out)
        with pytest.raises(tfmem.UnsupportedGraphError):
            tfmem.TFMemSession(plain, partition_size=2).run(out)
    from tfmem import autowrap  # pylint: disable=import-outside-toplevel
    with autowrap.install(partition_size=2) as installation:
        with tf1.Session(graph=g) as sess:
            for op in init:
                sess.run(op)
            assert sess.run(out) == expected
    totals = installation.recorder.totals()[0]
    assert totals.plain_runs >= 1 and "has inputs" in totals.plain_reasons[0]
