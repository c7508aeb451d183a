"""A MonitoredTrainingSession training program, run plainly and through tfmem.

The program is written the way TF1 training scripts are: a global step, a
summary, the standard hooks (checkpoint saver, summary saver, step counter,
logging, StopAtStepHook, NanTensorHook), a worker preempted in the middle
(recovered from its last checkpoint by MonitoredSession) and a restart of
the whole program from the checkpoint directory.  Each run is done twice,
with TensorFlow's MonitoredTrainingSession and with tfmem's, on graphs built
by the same function, and everything the program observes must agree:
losses step by step, summaries written, checkpointed variables.
"""

import glob
import os

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from conftest import session_config

tf1 = tf.compat.v1

PARTITION_SIZE = 12


def build():
    """A two-layer regression whose input is a function of the global step, so a
    restored worker replays exactly the steps it lost."""
    rs = np.random.RandomState(0)
    g = tf.Graph()
    with g.as_default():
        step = tf1.train.get_or_create_global_step()
        w1 = tf1.Variable((rs.standard_normal((4, 8)) * 0.5).astype(np.float32), name="w1")
        w2 = tf1.Variable((rs.standard_normal((8, 1)) * 0.5).astype(np.float32), name="w2")
        t = tf.cast(step, tf.float32, name="t")
        x = tf.sin(tf.reshape(tf.range(32, dtype=tf.float32), [8, 4]) * 0.1 + t * 0.3)
        target = tf.reduce_sum(x, axis=1, keepdims=True) * 0.5
        poison = tf1.placeholder_with_default(0.0, [], name="poison")
        pred = tf.matmul(tf.tanh(tf.matmul(x, w1)), w2)
        loss = tf.add(tf.reduce_mean(tf.square(pred - target)), poison, name="loss")
        tf1.summary.scalar("loss", loss)
        train = tf1.train.MomentumOptimizer(0.05, 0.9).minimize(loss, global_step=step)
    return g, dict(step=step, t=t, loss=loss, train=train, poison=poison)


class PreemptOnce(tf1.train.SessionRunHook):
    """Raises AbortedError (what a lost parameter server gives) before one step."""

    def __init__(self, at_call):
        self.at_call, self.calls, self.sessions = at_call, 0, []

    def after_create_session(self, session, coord):
        self.sessions.append(session)

    def before_run(self, run_context):
        self.calls += 1
        if self.calls == self.at_call:
            raise tf.errors.AbortedError(None, None, "worker preempted (test)")


def train(make_session, checkpoint_dir, last_step, preempt_at=None, **options):
    """Run the program; returns [(step, loss)] per run and the sessions the hooks saw."""
    g, m = build()
    observed = []
    with g.as_default():
        preempt = PreemptOnce(preempt_at)
        hooks = [tf1.train.StopAtStepHook(last_step=last_step),
                 tf1.train.NanTensorHook(m["loss"]),
                 tf1.train.LoggingTensorHook({"loss": m["loss"]}, every_n_iter=2),
                 preempt]
        with make_session(checkpoint_dir=checkpoint_dir, hooks=hooks, save_checkpoint_steps=5,
                          save_summaries_steps=3, log_step_count_steps=4,
                          config=session_config(), **options) as sess:
            while not sess.should_stop():
                _, loss, t = sess.run([m["train"], m["loss"], m["t"]])
                observed.append((int(t), float(loss)))
    return observed, preempt.sessions


def summaries(directory):
    """{step: loss} from the summary event files."""
    found = {}
    for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
        for event in tf1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag == "loss":
                    found[event.step] = value.simple_value
    return found


def checkpointed(directory):
    path = tf.train.latest_checkpoint(directory)
    return path, {name: tf.train.load_variable(path, name)
                  for name, _ in tf.train.list_variables(path)}


def _tfmem_session(**kwargs):
    return tfmem.MonitoredTrainingSession(partition_size=PARTITION_SIZE, **kwargs)


def test_training_with_hooks_preemption_and_restart(tmp_path):
    plain_dir, tfmem_dir = str(tmp_path / "plain"), str(tmp_path / "tfmem")
    runs = {}
    for name, make, directory in (("plain", tf1.train.MonitoredTrainingSession, plain_dir),
                                  ("tfmem", _tfmem_session, tfmem_dir)):
        first, sessions = train(make, directory, last_step=12, preempt_at=8)
        # the program restarts and continues from the checkpoint directory
        second, _ = train(make, directory, last_step=16)
        runs[name] = (first, second, sessions)
    (p1, p2, plain_sessions), (t1, t2, tfmem_sessions) = runs["plain"], runs["tfmem"]
    # the preempted worker came back from step 5's checkpoint and replayed 5..7
    assert [s for s, _ in p1] == [0, 1, 2, 3, 4, 5, 6, 5, 6, 7, 8, 9, 10, 11]
    assert [s for s, _ in t1] == [s for s, _ in p1]
    np.testing.assert_allclose([l for _, l in t1], [l for _, l in p1], rtol=1e-5)
    assert [s for s, _ in p2] == [12, 13, 14, 15]
    assert [s for s, _ in t2] == [s for s, _ in p2]
    np.testing.assert_allclose([l for _, l in t2], [l for _, l in p2], rtol=1e-5)
    # hooks were handed a TFMemSession, once more after the preemption, and ran partitioned
    assert len(plain_sessions) == len(tfmem_sessions) == 2
    assert all(isinstance(s, tfmem.TFMemSession) for s in tfmem_sessions)
    assert not any(isinstance(s, tfmem.TFMemSession) for s in plain_sessions)
    assert tfmem_sessions[-1].last_step.partitions > 1
    # the same summaries and checkpoints were written
    assert summaries(tfmem_dir).keys() == summaries(plain_dir).keys()
    np.testing.assert_allclose(list(summaries(tfmem_dir).values()),
                               list(summaries(plain_dir).values()), rtol=1e-5)
    plain_path, plain_vars = checkpointed(plain_dir)
    tfmem_path, tfmem_vars = checkpointed(tfmem_dir)
    assert os.path.basename(plain_path) == os.path.basename(tfmem_path) == "model.ckpt-16"
    assert plain_vars.keys() == tfmem_vars.keys()
    for name, value in plain_vars.items():
        np.testing.assert_allclose(tfmem_vars[name], value, rtol=1e-5, err_msg=name)


def test_nan_tensor_hook_stops_like_plain(tmp_path):
    def nan_step(make, directory):
        g, m = build()
        with g.as_default():
            hooks = [tf1.train.NanTensorHook(m["loss"])]
            with make(checkpoint_dir=directory, hooks=hooks, save_checkpoint_steps=None,
                      save_checkpoint_secs=None, save_summaries_steps=None,
                      config=session_config()) as sess:
                sess.run(m["train"])
                with pytest.raises(tf1.train.NanLossDuringTrainingError):
                    sess.run(m["train"], feed_dict={m["poison"]: np.nan})
                return sess.run(m["loss"])
    np.testing.assert_allclose(nan_step(_tfmem_session, str(tmp_path / "t")),
                               nan_step(tf1.train.MonitoredTrainingSession, str(tmp_path / "p")),
                               rtol=1e-5)


@pytest.mark.parametrize("kind", ["MonitoredSession", "SingularMonitoredSession", "creator"])
def test_monitored_session_kinds(kind):
    """Each way of building a monitored session runs its steps through tfmem."""
    results = {}
    for system in ("plain", "tfmem"):
        g, m = build()
        with g.as_default():
            seen = PreemptOnce(None)
            if system == "plain":
                make = getattr(tf1.train, "MonitoredSession" if kind == "creator" else kind)
                sess = make(hooks=[seen])
            elif kind == "creator":
                creator = tfmem.SessionCreator(
                    tf1.train.ChiefSessionCreator(config=session_config()),
                    partition_size=PARTITION_SIZE)
                sess = tf1.train.MonitoredSession(session_creator=creator, hooks=[seen])
            else:
                sess = getattr(tfmem, kind)(hooks=[seen], partition_size=PARTITION_SIZE)
            with sess:
                results[system] = [sess.run([m["train"], m["loss"]])[1] for _ in range(4)]
                assert g.finalized
        assert isinstance(seen.sessions[0], tfmem.TFMemSession) == (system == "tfmem")
        if system == "tfmem":
            assert seen.sessions[0].last_step.partitions > 1
    np.testing.assert_allclose(results["tfmem"], results["plain"], rtol=1e-5)


def test_unknown_option_is_refused():
    with pytest.raises(TypeError, match="partition_sise"):
        tfmem.SessionCreator(partition_sise=3)
