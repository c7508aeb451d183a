"""Can TensorFlow make Session callables while another callable of the same session runs?

Issue 12 names "compile later partitions while earlier ones run" as a way to
shorten tfmem's first step.  It only pays if DirectSession lets MakeCallable
and RunCallable proceed at the same time (GIL released, no shared lock held
for the whole call) and the two cores have room for both.  This measures it
on ResNet-56 (batch 32), in one process, with the tfmem session config:

  make alone: N distinct callables (each fetching one conv output), made serially;
  run alone:  the training step (one callable), run repeatedly;
  together:   the same N callables made in one thread while another runs steps.

Overlap = (make alone + steps done meanwhile x step time alone) / wall together:
1.0 means the two serialise, 2.0 means they overlap perfectly.

  probe:      a tiny callable (one scalar add) run again and again, alone and
              while the other thread makes callables: its latency shows whether a
              run must wait for the callable being made.

Why they serialise (TensorFlow 2.21, direct_session.cc/.h): MakeCallable
builds the callable's graph in `CreateGraphs` under `graph_state_lock_`
(copying and pruning the whole session graph), and every `RunCallable` first
calls `CheckGraphCreated`, which takes the same mutex.  A partition cannot
start while a callable's graph is being built.

    TF_ENABLE_ONEDNN_OPTS=0 python experiments/compile_overlap.py --callables 20 \
        --out experiments/results/compile-overlap.json
"""

import argparse
import json
import os
import statistics
import sys
import threading
import time

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402
from tensorflow.core.protobuf import config_pb2  # noqa: E402

import tfmem  # noqa: E402
from tfmem.cli import models  # noqa: E402
from tfmem import tf_private  # noqa: E402
from tfmem.cli import provenance  # noqa: E402


def _options(feeds, fetch, target=None):
    return config_pb2.CallableOptions(feed=feeds, fetch=[fetch],
                                      target=[target] if target else [])


def measure(n_callables, blocks, batch, rounds, intra=0, inter=0):
    model = models.resnet(blocks=blocks)
    feed = model.feed(batch)
    feed_names = [t.name for t in feed]
    values = [feed[t] for t in feed]
    config = tfmem.session_config()
    config.intra_op_parallelism_threads = intra  # 0: TensorFlow's default (one per core)
    config.inter_op_parallelism_threads = inter
    sess = tf.compat.v1.Session(graph=model.graph, config=config)
    sess.run(model.init)
    step = tf_private.make_callable(sess, _options(feed_names, model.loss.name, model.train.name))
    step(*values)  # first run: out of the timings
    convs = [op.outputs[0].name for op in model.graph.get_operations()
             if op.type in ("Conv2DBackpropInput", "Conv2DBackpropFilter", "Conv2D")]
    # the same fetches every time: TensorFlow builds a new callable for each request
    fetches = convs[::max(1, len(convs) // n_callables)][:n_callables]

    def make_batch():
        started = time.perf_counter()
        for fetch in fetches:
            tf_private.make_callable(sess, _options(feed_names, fetch))
        return time.perf_counter() - started

    def run_steps(count):
        started = time.perf_counter()
        for _ in range(count):
            step(*values)
        return (time.perf_counter() - started) / count

    with model.graph.as_default():
        tiny = tf.add(tf.constant(1.0), tf.constant(2.0), name="compile_overlap_probe")
    probe = tf_private.make_callable(sess, _options([], tiny.name))
    probe()

    def probe_latencies(stop_after=None, count=200):
        """Latencies of the probe, one run every 5 ms (paced, so the thread making
        callables gets the GIL between its calls)."""
        latencies = []
        while (stop_after is None and len(latencies) < count) or \
                (stop_after is not None and not stop_after.is_set()):
            t0 = time.perf_counter()
            probe()
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.005)
        return latencies

    def slow_share(latencies):
        return sum(1 for v in latencies if v > 0.005) / len(latencies)

    rows = []
    for _ in range(rounds):
        alone = probe_latencies()
        made = threading.Event()
        maker = threading.Thread(target=lambda: (make_batch(), made.set()))
        maker.start()
        during = probe_latencies(stop_after=made)
        maker.join()
        print(f"probe run: median {statistics.median(alone) * 1e3:.2f} ms alone, "
              f"{slow_share(alone):.0%} over 5 ms; while making {n_callables} callables: "
              f"median {statistics.median(during) * 1e3:.1f} ms, {slow_share(during):.0%} over "
              f"5 ms, max {max(during) * 1e3:.0f} ms ({len(during)} runs)", flush=True)
        make_alone = make_batch()
        step_alone = run_steps(3)
        done = []
        stop = threading.Event()

        def runner():
            while not stop.is_set():
                t0 = time.perf_counter()
                step(*values)
                done.append(time.perf_counter() - t0)

        thread = threading.Thread(target=runner)
        started = time.perf_counter()
        thread.start()
        make_together = make_batch()
        stop.set()
        thread.join()
        wall = time.perf_counter() - started
        # steps that finished while making: count the fraction of the last one inside
        work = make_alone + sum(done) / statistics.median(done) * step_alone
        rows.append(dict(probe_alone_ms=statistics.median(alone) * 1e3,
                         probe_during_ms=statistics.median(during) * 1e3,
                         probe_slow_alone=slow_share(alone), probe_slow_during=slow_share(during),
                         make_alone=make_alone, step_alone=step_alone,
                         make_together=make_together, steps_together=len(done),
                         wall_together=wall, overlap=work / wall))
        print(f"make {n_callables} alone {make_alone:.2f} s; step alone {step_alone:.3f} s; "
              f"together: make {make_together:.2f} s while {len(done)} steps ran "
              f"(median {statistics.median(done):.3f} s each), wall {wall:.2f} s; "
              f"overlap {work / wall:.2f}", flush=True)
    sess.close()
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--callables", type=int, default=20)
    parser.add_argument("--blocks", type=int, default=9)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--intra", type=int, default=0, help="intra-op threads (0: default)")
    parser.add_argument("--inter", type=int, default=0, help="inter-op threads (0: default)")
    parser.add_argument("--out", help="write the rows and their provenance to this JSON file")
    args = parser.parse_args(argv)
    print(f"TensorFlow {tf.__version__}, oneDNN {os.environ['TF_ENABLE_ONEDNN_OPTS']}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; threads intra {args.intra} "
          f"inter {args.inter} (0: default)", flush=True)
    rows = measure(args.callables, (args.blocks,) * 3, args.batch, args.rounds, args.intra,
                   args.inter)
    print(f"median probe latency {statistics.median(r['probe_alone_ms'] for r in rows):.2f} ms "
          f"alone, {statistics.median(r['probe_during_ms'] for r in rows):.1f} ms while making; "
          f"runs over 5 ms: {statistics.median(r['probe_slow_alone'] for r in rows):.0%} alone, "
          f"{statistics.median(r['probe_slow_during'] for r in rows):.0%} while making")
    print(f"median overlap {statistics.median(r['overlap'] for r in rows):.2f} "
          f"(1.0: serialised, 2.0: perfect); load {os.getloadavg()[0]:.1f}")
    if args.out:
        kernel = "oneDNN" if os.environ["TF_ENABLE_ONEDNN_OPTS"] == "1" else "Eigen (oneDNN off)"
        with open(args.out, "w", encoding="utf-8") as out:
            json.dump(dict(provenance=provenance.provenance(kernel), settings=vars(args),
                           rows=rows), out, indent=1)


if __name__ == "__main__":
    sys.exit(main())
