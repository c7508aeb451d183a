"""What running random ops in functions of their own costs a budget-mode step (issue 15).

In budget mode tfmem.function runs each stream op (dropout's RandomUniform here)
as an eager call of a function shared by every plan of the trace
(tfmem/tf2/streams.py).  An MLP of `--layers` Dense + ReLU + dropout layers,
trained by hand-written SGD, runs as a plain tf.function and as a budget-mode
tfmem.function whose budget (8 GiB) is far above the step (one partition);
steps alternate, the order flipped every step.  Prints the median step times,
their ratio, the median of adjacent steps' ratios, and the extra time per
stream op.  `--generic` traces with a None batch dimension (the partition is
cut at each random op then; with static shapes the ops draw first, uncut).

    python tools/bench_streams_tf2.py --layers 8 --width 256 --batch 64
"""

import argparse
import os
import time


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--generic", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tfmem  # pylint: disable=import-outside-toplevel
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)

    def make():
        rng = np.random.default_rng(0)
        weights = [tf.Variable(rng.standard_normal((args.width, args.width)).astype(np.float32)
                               * 0.05) for _ in range(args.layers)]

        def step(x):
            with tf.GradientTape() as tape:
                h = x
                for w in weights:
                    h = tf.nn.dropout(tf.nn.relu(h @ w), 0.5, seed=1)
                loss = tf.reduce_mean(h * h)
            for w, g in zip(weights, tape.gradient(loss, weights)):
                w.assign_sub(0.01 * g)
            return loss
        return step

    signature = [tf.TensorSpec((None, args.width), tf.float32)] if args.generic else None
    x = tf.ones((args.batch, args.width))
    plain = tf.function(make(), input_signature=signature)
    wrapped = tfmem.function(make(), device_memory_budget="8GiB", input_signature=signature)
    for fn in (plain, wrapped):
        fn(x)
        fn(x)
    times = {plain: [], wrapped: []}
    for i in range(args.steps):
        for fn in ((plain, wrapped) if i % 2 else (wrapped, plain)):
            started = time.perf_counter()
            fn(x).numpy()
            times[fn].append(time.perf_counter() - started)
    plain_ms = np.median(times[plain]) * 1e3
    tfmem_ms = np.median(times[wrapped]) * 1e3
    paired = np.median(np.array(times[wrapped]) / np.array(times[plain]))
    print(f"layers {args.layers}, width {args.width}, batch {args.batch}, "
          f"{'generic' if args.generic else 'static'} shapes, "
          f"{wrapped.last_step.partitions} partition(s), {args.steps} steps a side: plain "
          f"{plain_ms:.2f} ms, tfmem {tfmem_ms:.2f} ms, ratio {tfmem_ms / plain_ms:.3f}, "
          f"paired {paired:.3f}, {(tfmem_ms - plain_ms) / args.layers * 1e3:.0f} us per "
          f"random op; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
