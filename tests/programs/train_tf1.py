"""A TF1-style training program, as users have them, for the tests of `tfmem run`.

    python train_tf1.py --mode queue,monitored,supervisor --steps N --logdir DIR

Nothing in it knows about tfmem.  It prints one `loss <step> <value>` line
per training step, and `sessions <class names>` after each mode, so a run through
`tfmem run` can be compared with a plain run line by line.

queue:      a queue-runner input pipeline (slice_input_producer -> batch),
            a Coordinator, a Saver checkpoint saved and restored.
monitored:  MonitoredTrainingSession with the standard hooks, then a second
            one on a new graph that restores the checkpoint and continues.
supervisor: Supervisor.managed_session with its queue runners.
"""

import argparse
import os

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1
CONFIG = tf1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=2)


def model(xb, yb):
    """A small MLP with a hand-made deep tail, so partitions are many."""
    rs = np.random.RandomState(0)
    step = tf1.train.get_or_create_global_step()
    w1 = tf1.Variable((rs.standard_normal((6, 16)) * 0.4).astype(np.float32), name="w1")
    w2 = tf1.Variable((rs.standard_normal((16, 1)) * 0.4).astype(np.float32), name="w2")
    h = tf.tanh(tf.matmul(xb, w1))
    for i in range(4):
        h = tf.nn.relu(h * 0.9 + 0.05, name=f"tail{i}")
    logits = tf.squeeze(tf.matmul(h, w2), 1)
    loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=yb, logits=logits),
                          name="loss")
    tf1.summary.scalar("loss", loss)
    train = tf1.train.MomentumOptimizer(0.1, 0.9).minimize(loss, global_step=step)
    return step, loss, train


def data():
    rs = np.random.RandomState(1)
    features = rs.standard_normal((64, 6)).astype(np.float32)
    labels = (features[:, 0] - features[:, 1] > 0).astype(np.float32)
    return features, labels


def pipeline():
    features, labels = data()
    feature, label = tf1.train.slice_input_producer(
        [tf.constant(features), tf.constant(labels)], shuffle=False)
    return tf1.train.batch([feature * 1.5, label], batch_size=8, num_threads=1)


def run_queue(args):
    with tf.Graph().as_default():
        _, loss, train = model(*pipeline())
        saver = tf1.train.Saver()
        sess = tf1.Session(config=CONFIG)
        sess.run(tf1.global_variables_initializer())
        coord = tf1.train.Coordinator()
        threads = tf1.train.start_queue_runners(sess=sess, coord=coord)
        for i in range(args.steps):
            print(f"loss {i} {sess.run([train, loss])[1]:.9e}", flush=True)
        path = saver.save(sess, os.path.join(args.logdir, "model.ckpt"))
        sess.run(train)  # a step that the restore undoes
        saver.restore(sess, path)
        print(f"loss restored {sess.run(loss):.9e}")
        coord.request_stop()
        coord.join(threads)
        names = [type(sess).__name__]
        sess.close()
    return names


def run_monitored(args):
    names = []
    for last_step in (args.steps // 2, args.steps):
        with tf.Graph().as_default():
            features, labels = data()
            x = tf1.placeholder(tf.float32, [None, 6])
            y = tf1.placeholder(tf.float32, [None])
            step, loss, train = model(x, y)
            hooks = [tf1.train.StopAtStepHook(last_step=last_step),
                     tf1.train.NanTensorHook(loss),
                     tf1.train.LoggingTensorHook({"loss": loss}, every_n_iter=3)]
            with tf1.train.MonitoredTrainingSession(
                    checkpoint_dir=args.logdir, hooks=hooks, save_checkpoint_steps=2,
                    save_summaries_steps=2, log_step_count_steps=2, config=CONFIG) as sess:
                while not sess.should_stop():
                    i = sess.run_step_fn(lambda step_context: step_context.session.run(step))
                    batch = {x: features[(i * 8) % 64:][:8], y: labels[(i * 8) % 64:][:8]}
                    print(f"loss {i} {sess.run([train, loss], batch)[1]:.9e}", flush=True)
                names.append(type(sess._tf_sess()).__name__)  # pylint: disable=protected-access
    return names


def run_supervisor(args):
    with tf.Graph().as_default():
        _, loss, train = model(*pipeline())
        sv = tf1.train.Supervisor(logdir=args.logdir, summary_op=None, save_model_secs=0)
        with sv.managed_session(config=CONFIG) as sess:
            for i in range(args.steps):
                print(f"loss {i} {sess.run([train, loss])[1]:.9e}", flush=True)
            sv.saver.save(sess, os.path.join(args.logdir, "model.ckpt"))
            names = [type(sess).__name__]
        sv.stop()
    return names


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True, help="comma-separated: queue, monitored, supervisor")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--logdir", required=True)
    args = parser.parse_args()
    tf1.disable_eager_execution()  # as TF1 programs do under TensorFlow 2 (threads included)
    logdir = args.logdir
    for mode in args.mode.split(","):
        args.logdir = os.path.join(logdir, mode)
        os.makedirs(args.logdir, exist_ok=True)
        names = {"queue": run_queue, "monitored": run_monitored,
                 "supervisor": run_supervisor}[mode](args)
        print(f"sessions {mode} " + " ".join(names))


if __name__ == "__main__":
    main()
