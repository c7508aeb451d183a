"""Benchmark: what `tfmem.function(profile_peaks=True)` costs per step.

    python tools/bench_peaks_tf2.py [--steps 12] [--warmup 2] [--cap-mib 1024]
                                    [--partition-sizes 200 20] [--onednn 0|1]

One process with the emulated accelerator (the allocator keeps figures, so
both sides measure peaks), one intra-op thread, two inter-op.  Per partition
size, two identically seeded copies of the benchmark's Keras ResNet (2, 2, 2),
batch 32, are wrapped by `tfmem.function`, one with `profile_peaks=True`,
and stepped alternately (order flipped every step) beside a plain
`tf.function`.  Printed per size: partitions, median step times, the ratio
profiled / unprofiled, the median extra milliseconds per step and per
partition, and how many partition peaks each side measured (the unprofiled
side gets None for partitions under the process peak).
"""

import argparse
import os
import statistics
import sys
import time


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cap-mib", type=int, default=1024)
    parser.add_argument("--partition-sizes", nargs="+", type=int, default=[200, 20])
    parser.add_argument("--onednn", choices=("0", "1"), default="0")
    return parser.parse_args()


def _timed(fn, *args):
    started = time.perf_counter()
    float(fn(*args))
    return time.perf_counter() - started


def main():
    args = _parse()
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = args.onednn
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    import tfmem  # pylint: disable=import-outside-toplevel
    tfmem.emulate_accelerator(args.cap_mib)
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import keras  # pylint: disable=import-outside-toplevel
    from tfmem.cli.tf2_models import build_resnet, make_step  # pylint: disable=import-outside-toplevel
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    rng = np.random.default_rng(0)
    data = (tf.constant(rng.standard_normal((32, 32, 32, 3)).astype(np.float32)),
            tf.constant(rng.integers(0, 10, 32).astype(np.int32)))
    print(f"profile_peaks cost: Keras ResNet (2, 2, 2), batch 32, emulated cap "
          f"{args.cap_mib} MiB, TF_ENABLE_ONEDNN_OPTS={args.onednn}, intra-op 1, inter-op 2, "
          f"{args.steps} steps per side after {args.warmup}, alternating; load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'size':>5} {'parts':>5} {'plain ms':>8} {'tfmem ms':>8} {'profiled ms':>11} "
          f"{'ratio':>6} {'extra ms':>8} {'ms/part':>7} {'measured':>9} {'profiled':>9}")
    for size in args.partition_sizes:
        sides = {"plain": tf.function(make_step(tf, keras, build_resnet(keras, (2, 2, 2))))}
        for name, profiled in (("tfmem", False), ("profiled", True)):
            model = build_resnet(keras, (2, 2, 2))
            sides[name] = tfmem.function(make_step(tf, keras, model), partition_size=size,
                                         options=tfmem.Options(profile_peaks=profiled))
        for _ in range(args.warmup):
            for fn in sides.values():
                _timed(fn, *data)
        times = {name: [] for name in sides}
        counts = {"tfmem": [], "profiled": []}
        names = list(sides)
        for i in range(args.steps):
            for name in (names if i % 2 == 0 else names[::-1]):
                times[name].append(_timed(sides[name], *data))
                if name in counts:
                    peaks = sides[name].last_step.partition_peak_bytes or ()
                    counts[name].append(sum(p is not None for p in peaks))
        median = {name: statistics.median(t) for name, t in times.items()}
        extra = statistics.median(p - t for p, t in zip(times["profiled"], times["tfmem"]))
        parts = sides["tfmem"].last_step.partitions
        total = parts * args.steps
        print(f"{size:>5} {parts:>5} {median['plain'] * 1e3:>8.1f} {median['tfmem'] * 1e3:>8.1f} "
              f"{median['profiled'] * 1e3:>11.1f} {median['profiled'] / median['tfmem']:>6.3f} "
              f"{extra * 1e3:>8.1f} {extra * 1e3 / parts:>7.2f} "
              f"{sum(counts['tfmem']):>4}/{total:<4} {sum(counts['profiled']):>4}/{total:<4}")


if __name__ == "__main__":
    main()
