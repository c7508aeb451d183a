"""Executor order: does the order TensorFlow runs a partition's ops explain its peak?

    python experiments/executor_order.py --model moe --onednn 0 --partition-size 200
    python experiments/executor_order.py --model moe --onednn 1 --processes 2
    python experiments/executor_order.py --model deepspeech --partition-size 100000

TensorFlow's executor (`ExecutorState::ScheduleReady`) runs the ready ops its
cost model calls inexpensive inline, first in first out, and hands the
expensive ones to the inter-op pool, each op's readers in the order of its
output edges: the order they were added up to eight, a hash of addresses
beyond, so the order can differ from process to process.  The simulator
takes the worst of the depth-first order and the executor emulated
(tfmem/memory/op_order.py).

Each fresh process (pinned thread pools, TensorFlow's BFC allocator far
above the step, the kernel path set explicitly) trains one model of
experiments/accuracy.py's MODELS, or the DeepSpeech experiment's model,
through `TFMemSession(measure="every")`, then traces one step
(`RunOptions(FULL_TRACE)`: every op's start time).  Per partition it prints
the peak TensorFlow measured in the last untraced step and in the traced
one, and the simulator's requested peak in its own orders (the worst of the
three that follow), depth first in the plan's order, the executor emulated
(tfmem/memory/op_order.py) with each op's readers in node-id order and
reversed, first-in-first-out over ready ops (the inline queue with every op
cheap), and the order TensorFlow ran the ops in that process (by start
time; ops it did not run, removed by Grappler, as soon as ready).
Figures include the request's state, less what earlier allocations left.
Nothing here is asserted.
"""

import argparse
import itertools
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "experiments"))

MIB = 1 << 20


def fifo_priority():
    """A ready-op priority (see op_order.dependency_order): the order ops became ready."""
    arrivals = itertools.count()
    return lambda name, position: next(arrivals)


def started_priority(started):
    """A ready-op priority: the op TensorFlow started first (`started`: {op name: start
    time}; ops it did not run, removed by Grappler, as soon as ready), then the plan's."""
    return lambda name, position: (started.get(name, -1), position)


def deepspeech_session(size):
    """accuracy.measured_session's tuple for the DeepSpeech experiment's model (32 frames,
    batch 128) under tfmem's session config, one thread per pool."""
    # pylint: disable=import-outside-toplevel
    import types
    import tensorflow as tf
    import tfmem
    import deepspeech

    args = types.SimpleNamespace(features=26, hidden=128, classes=29, seed=0, batch_size=128,
                                 learning_rate=0.001)
    model = deepspeech.build(tf, 32, args)
    config = tfmem.session_config(tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                                            inter_op_parallelism_threads=1))
    sess = tf.compat.v1.Session(graph=model.graph, config=config)
    tfmem.TFMemSession(sess, partition_size=100000).run(model.init)
    tfs = tfmem.TFMemSession(sess, partition_size=size, measure="every")
    return model, sess, tfs, model.feed, [model.train_op, model.loss]


def worker(name, size, steps):
    """One process's figures (see the docstring)."""
    # pylint: disable=import-outside-toplevel
    from tensorflow.core.protobuf import config_pb2
    import accuracy
    import tfmem
    from tfmem.memory import op_order, simulate as simulator
    from tfmem.memory.sizing import Sizing
    from tfmem.run import accelerator

    if name == "deepspeech":
        model, sess, tfs, feed, fetches = deepspeech_session(size)
    else:
        builder, kwargs, batch = accuracy.MODELS[name]
        model, sess, tfs, feed, fetches = accuracy.measured_session(builder, kwargs, batch, size)
    # TensorFlow's executor orders the copies here: chained (op_order.chained_order),
    # they would run in the depth-first order
    tfs = tfmem.TFMemSession(sess, partition_size=size,
                             options=tfmem.Options(measure="every", chain_copies=False))
    plan = tfs.plan(fetches, feed)
    sizing = Sizing.of(model.graph, plan.view, {t.name: v.shape for t, v in feed.items()}, sess)
    state = tfs.simulate(fetches, feed).state_bytes
    for _ in range(steps):
        tfs.run(fetches, feed)
    measured = list(tfs.last_step.partition_peak_bytes)
    foreign = accelerator.device_memory("CPU:0")["current"] - state
    metadata = config_pb2.RunMetadata()
    tfs.run(fetches, feed, run_metadata=metadata,
            options=config_pb2.RunOptions(trace_level=config_pb2.RunOptions.FULL_TRACE))
    traced = list(tfs.last_step.partition_peak_bytes)
    started = {}
    for device in metadata.step_stats.dev_stats:
        for node in device.node_stats:  # copies are named tfmem/plan<k>/p<i>[_in|_out]/<op>
            match = re.search(r"/p\d+(?:_in|_out)?/(.*)$", node.node_name)
            op = match.group(1) if match else node.node_name
            started.setdefault(op, node.all_start_micros)
    candidates = simulator.partition_orders
    orders = {
        "simulator's (the worst of three)": candidates,
        "depth-first": lambda view, ops, _: [op_order.dependency_order(view, ops)],
        "executor": lambda view, ops, originals: [
            op_order.executor_orders(view, ops, originals)[0]],
        "executor, readers reversed": lambda view, ops, originals: [
            op_order.executor_orders(view, ops, originals)[1]],
        "fifo": lambda view, ops, _: [op_order.dependency_order(view, ops, fifo_priority())],
        "tensorflow's": lambda view, ops, _: [op_order.dependency_order(
            view, ops, started_priority(started))]}
    predicted = {}
    try:
        for label, order in orders.items():
            simulator.partition_orders = order
            trace = simulator.simulate(plan, sizing.shapes, scratch=sizing.scratch,
                                       **sizing.simulate_options())
            predicted[label] = [p.device_peak for p in trace.partitions]
    finally:
        simulator.partition_orders = candidates
    tfs.close()

    def own(peaks):
        return [None if p is None else p - foreign for p in peaks]
    return dict(measured=own(measured), traced=own(traced), predicted=predicted)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="moe",
                        help="a name of accuracy.MODELS, or deepspeech (32 frames, batch 128)")
    parser.add_argument("--onednn", choices=("0", "1"), default="0")
    parser.add_argument("--partition-size", type=int, default=200)
    parser.add_argument("--processes", type=int, default=4, help="fresh processes, one at a time")
    parser.add_argument("--steps", type=int, default=5, help="steps before the traced one")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.model, args.partition_size, args.steps)))
        return 0
    from tfmem.cli import child_env  # pylint: disable=import-outside-toplevel
    env = child_env.child_env(onednn=args.onednn == "1")
    print(f"{args.model}, oneDNN {'on' if args.onednn == '1' else 'off'}, partition size "
          f"{args.partition_size}: per partition, MiB (the request's state included)")
    for number in range(args.processes):
        done = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--worker", "--model", args.model,
             "--partition-size", str(args.partition_size), "--steps", str(args.steps)],
            capture_output=True, text=True, env=env, timeout=900, check=False)
        if done.returncode != 0:
            print(f"process {number}: {child_env.describe_exit(done.returncode)}\n"
                  f"{done.stderr[-2000:]}")
            continue
        data = json.loads(done.stdout.strip().splitlines()[-1])
        for index, measured in enumerate(data["measured"]):
            figures = [data["traced"][index]] + [data["predicted"][label][index]
                                                 for label in data["predicted"]]
            shown = "  ".join(f"{label} {'-' if value is None else f'{value / MIB:.2f}'}"
                              for label, value in zip(
                                  ["traced step"] + [f"simulated in {k} order"
                                                     for k in data["predicted"]], figures))
            measured_text = '-' if measured is None else f"{measured / MIB:.2f}"
            print(f"process {number} partition {index}: measured {measured_text}  {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
