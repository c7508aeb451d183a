"""cProfile of tfmem steps on the model of (a) (`--profile`)."""

import time

import tfmem

from tools.bench_sections.shared import session, tensorflow


def run(blocks=(9, 9, 9), batch=32, partition_sizes=(50, 200), steps=5, top=18,
                 log=print):
    """cProfile of tfmem steps (after 3 unprofiled ones); prints the top functions.

    For native frames (inside TensorFlow) run the bench under py-spy instead:
    `py-spy record --native -o spy.svg -- python tools/bench.py --profile ...`.
    """
    import cProfile  # pylint: disable=import-outside-toplevel
    import io  # pylint: disable=import-outside-toplevel
    import pstats  # pylint: disable=import-outside-toplevel
    tf = tensorflow()
    from tfmem.cli import models  # pylint: disable=import-outside-toplevel
    model = models.resnet(blocks=blocks)
    feed = model.feed(batch)
    fetches = [model.train, model.loss]
    sess = session(tf, model.graph)
    sess.run(model.init)
    out = {}
    for size in partition_sizes:
        tfs = tfmem.TFMemSession(sess, partition_size=size)
        for _ in range(3):
            tfs.run(fetches, feed)
        profiler = cProfile.Profile()
        started = time.perf_counter()
        profiler.enable()
        for _ in range(steps):
            tfs.run(fetches, feed)
        profiler.disable()
        wall = time.perf_counter() - started
        stream = io.StringIO()
        stats = pstats.Stats(profiler, stream=stream)
        stats.sort_stats("tottime").print_stats(top)
        raw = stats.stats  # pylint: disable=no-member
        tf_s = sum(v[2] for k, v in raw.items() if "TF_SessionRunCallable" in k[2])
        out[size] = dict(wall_s=wall, tf_call_s=tf_s, steps=steps,
                         partitions=tfs.last_step.partitions)
        log(f"--- cProfile, partition_size={size}, {steps} steps, "
            f"{tfs.last_step.partitions} partitions: wall {wall:.2f} s, in "
            f"TF_SessionRunCallable {tf_s:.2f} s ({tf_s / wall:.0%}), Python "
            f"{(wall - tf_s) / steps / tfs.last_step.partitions * 1e3:.3f} ms/partition "
            f"(profiled)")
        log("\n".join(stream.getvalue().splitlines()[:top + 12]))
    sess.close()
    return out
