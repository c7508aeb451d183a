"""Side-by-side demo: train one small graph-mode MLP through a plain
``tf.compat.v1.Session`` and through :class:`tfmem.TFMemSession`.

Both sessions share one graph and start from the same initial values (the
initialisers are numpy constants), so every step must report the same loss.
The demo prints a per-step loss table, the number of partitions tfmem cut the
training request into, the largest loss difference and the median time per
step of both sessions.

Run it with ``tfmem demo`` or ``python -m tfmem demo``; ``--help`` lists the
options.
"""

import argparse
import os
import statistics
import time

RTOL = 1e-4
ATOL = 1e-6

INPUT_DIM = 64
HIDDEN_DIMS = (128, 128, 128)
NUM_CLASSES = 10
NUM_EXAMPLES = 1024


def _positive_int(text):
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def add_arguments(parser):
    """Add the demo's options to ``parser`` (shared with ``tfmem demo``)."""
    parser.add_argument("--steps", type=_positive_int, default=20,
                        help="training steps per session (default: 20)")
    parser.add_argument("--partition-size", type=_positive_int, default=50,
                        help="max ops per partition for TFMemSession (default: 50)")
    parser.add_argument("--batch-size", type=_positive_int, default=64,
                        help="examples per step (default: 64)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed for the synthetic data and the initial weights (default: 0)")
    return parser


def _synthetic_data(np, seed):
    """A seeded classification task: labels from a random linear teacher."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((NUM_EXAMPLES, INPUT_DIM)).astype(np.float32)
    teacher = rng.standard_normal((INPUT_DIM, NUM_CLASSES)).astype(np.float32)
    y = np.argmax(x @ teacher, axis=1).astype(np.int64)
    return x, y


def _build_model(tf, np, seed):
    """A 4-layer MLP with a momentum-SGD train op, built in graph mode."""
    rng = np.random.default_rng(seed + 1)
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, INPUT_DIM], name="x")
        y = tf.compat.v1.placeholder(tf.int64, [None], name="y")
        h = x
        dims = (INPUT_DIM,) + HIDDEN_DIMS + (NUM_CLASSES,)
        for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:])):
            with tf.compat.v1.variable_scope(f"layer{i}"):
                w0 = (rng.standard_normal((d_in, d_out)) * np.sqrt(2.0 / d_in)).astype(np.float32)
                w = tf.compat.v1.Variable(w0, name="w", use_resource=True)
                b = tf.compat.v1.Variable(np.zeros(d_out, np.float32), name="b", use_resource=True)
                h = tf.matmul(h, w) + b
                if i < len(dims) - 2:
                    h = tf.nn.relu(h)
        loss = tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=h), name="loss")
        optimizer = tf.compat.v1.train.MomentumOptimizer(learning_rate=0.05, momentum=0.9)
        train_op = optimizer.minimize(loss)
        init = tf.compat.v1.global_variables_initializer()
    return graph, x, y, loss, train_op, init


def run(args):
    """Run the demo with parsed ``args``; return the exit code."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    import tfmem

    data_x, data_y = _synthetic_data(np, args.seed)
    graph, x, y, loss, train_op, init = _build_model(tf, np, args.seed)

    def batch(step):
        start = (step * args.batch_size) % NUM_EXAMPLES
        idx = np.arange(start, start + args.batch_size) % NUM_EXAMPLES
        return {x: data_x[idx], y: data_y[idx]}

    plain = tf.compat.v1.Session(graph=graph)
    with plain, tfmem.TFMemSession(tf.compat.v1.Session(graph=graph),
                                   partition_size=args.partition_size) as tfs:
        plain.run(init)
        tfs.run(init)
        plan = tfs.plan([train_op, loss], feed_dict=batch(0))

        print(f"tfmem demo: 4-layer MLP {INPUT_DIM}-{'-'.join(map(str, HIDDEN_DIMS))}-"
              f"{NUM_CLASSES}, batch {args.batch_size}, {args.steps} steps, "
              f"partition_size {args.partition_size}")
        print(f"{'step':>4}  {'plain loss':>12}  {'tfmem loss':>12}  {'abs diff':>9}")
        plain_losses, tfmem_losses = [], []
        plain_times, tfmem_times = [], []
        for step in range(args.steps):
            feed = batch(step)
            t0 = time.perf_counter()
            _, plain_loss = plain.run([train_op, loss], feed_dict=feed)
            t1 = time.perf_counter()
            _, tfmem_loss = tfs.run([train_op, loss], feed_dict=feed)
            t2 = time.perf_counter()
            plain_times.append(t1 - t0)
            tfmem_times.append(t2 - t1)
            plain_losses.append(float(plain_loss))
            tfmem_losses.append(float(tfmem_loss))
            print(f"{step:>4}  {plain_loss:>12.6f}  {tfmem_loss:>12.6f}  "
                  f"{abs(plain_loss - tfmem_loss):>9.2e}")

    plain_losses = np.array(plain_losses)
    tfmem_losses = np.array(tfmem_losses)
    max_diff = float(np.max(np.abs(plain_losses - tfmem_losses)))
    plain_ms = 1e3 * statistics.median(plain_times)
    tfmem_ms = 1e3 * statistics.median(tfmem_times)
    print(f"partitions in the train request: {len(plan.partitions)} "
          f"({len(plan.transfers)} tensors cross partitions)")
    print(f"max abs loss difference: {max_diff:.3e}")
    print(f"median time per step: plain {plain_ms:.2f} ms, tfmem {tfmem_ms:.2f} ms "
          f"({tfmem_ms / plain_ms:.2f}x)")

    if np.allclose(tfmem_losses, plain_losses, rtol=RTOL, atol=ATOL):
        print(f"losses match (rtol {RTOL:g})")
        return 0
    bad = np.flatnonzero(~np.isclose(tfmem_losses, plain_losses, rtol=RTOL, atol=ATOL))
    print(f"LOSS MISMATCH: tfmem and plain losses differ beyond rtol {RTOL:g} "
          f"at step(s) {', '.join(map(str, bad.tolist()))} "
          f"(first: plain {plain_losses[bad[0]]:.6f}, tfmem {tfmem_losses[bad[0]]:.6f})")
    return 1


def main(argv=None):
    """Entry point of ``tfmem demo``: parse ``argv`` and run the demo."""
    parser = add_arguments(argparse.ArgumentParser(
        prog="tfmem demo",
        description="Train a small MLP through a plain Session and TFMemSession "
                    "side by side and compare losses and step times."))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
