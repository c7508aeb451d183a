"""Probe: is a partitioned Keras step bit-equal to `tf.function`, variable by variable?

    python tools/probe_bitequal_tf2.py [--blocks 3 3 3] [--batch 32] [--sizes 200 50]
                                       [--steps 8] [--intra 2] [--inter 2] [--onednn 0|1]

The benchmark's Keras ResNet (tools/bench_tf2.py) with SGD and momentum is
built twice from one seed; one copy runs under `tf.function`, the other under
`tfmem.function(partition_size=N)`.  After every step each variable of the
model and of the optimizer (the momenta too: a 1-ulp difference in a momentum
can take many steps to reach the loss) is compared bit for bit, and the
differing ones are printed with their largest difference.  A second plain
copy checks that `tf.function` itself is deterministic with these threads.
Thread pools are pinned through `tf.config.threading`; TF_ENABLE_ONEDNN_OPTS
is set from `--onednn` before TensorFlow starts.  (0, 0, 0) blocks, batch 8
and 2 steps give a model of about 200 ops that runs in seconds.

To see what differs, dump the graphs TensorFlow runs for the whole function
and for each partition: TF_DUMP_GRAPH_PREFIX=DIR TF_DUMP_GRAPH_NAME_FILTER='*'
(files `*after_partition_passes.pbtxt`; partition nodes carry the names of
tfmem.tf2.sorted_names, `sorted_names.decode` reads them).
"""

import argparse
import os
import sys
import time


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, nargs=3, default=(3, 3, 3))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--sizes", type=int, nargs="+", default=[200, 50])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--intra", type=int, default=2, help="intra-op threads (pinned)")
    parser.add_argument("--inter", type=int, default=2, help="inter-op threads (pinned)")
    parser.add_argument("--onednn", choices=("0", "1"), default="0")
    return parser.parse_args()


def _differing(np, variables, others):
    """[(path, elements differing, largest difference)] of two variable lists."""
    out = []
    for v, w in zip(variables, others):
        a, b = v.numpy(), w.numpy()
        if not np.array_equal(a, b):
            out.append((v.path, int((a != b).sum()), float(np.max(np.abs(a - b)))))
    return out


def main():
    args = _parse()
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.dirname(here))
    sys.path.insert(0, here)
    from bench_tf2 import build_resnet, make_step, start_tensorflow  # pylint: disable=import-outside-toplevel
    np, tf, keras = start_tensorflow(args)
    import tfmem  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((args.batch, 32, 32, 3)).astype(np.float32))
    y = tf.constant(rng.integers(0, 10, args.batch).astype(np.int32))
    print(f"Keras ResNet blocks {tuple(args.blocks)}, batch {args.batch}, SGD momentum; "
          f"TF_ENABLE_ONEDNN_OPTS={args.onednn}, intra-op {args.intra}, inter-op {args.inter}")
    status = 0
    for size in args.sizes:
        copies = []
        for _ in range(3):  # plain, a second plain (determinism), partitioned
            model = build_resnet(keras, args.blocks)
            optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
            copies.append((make_step(tf, keras, model, optimizer),
                           model.variables + optimizer.variables))
        plain, again = tf.function(copies[0][0]), tf.function(copies[1][0])
        partitioned = tfmem.function(copies[2][0], partition_size=size)
        started = time.perf_counter()
        for step in range(1, args.steps + 1):
            losses = [float(f(x, y)) for f in (plain, again, partitioned)]
            unstable = _differing(np, copies[0][1], copies[1][1]) or losses[0] != losses[1]
            differs = _differing(np, copies[0][1], copies[2][1])
            print(f"size {size} step {step}: loss {'equal' if losses[0] == losses[2] else 'DIFFERS'}"
                  f", {len(differs)} variables differ"
                  f"{', PLAIN NOT DETERMINISTIC' if unstable else ''}", flush=True)
            for path, count, largest in differs[:5]:
                print(f"    {path}: {count} elements, largest difference {largest:.3e}")
            status = status or int(bool(differs) or losses[0] != losses[2])
        print(f"size {size}: {partitioned.last_step.partitions} partitions, "
              f"{time.perf_counter() - started:.1f} s")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
