"""Step chunks: where a plain step's allocator peak goes, against the simulator's.

    python experiments/step_chunks.py --model pool --onednn 1
    python experiments/step_chunks.py --model conv --onednn 1 --steps 4
    python experiments/step_chunks.py --model conv --onednn 1 --partition-size 50

Trains one model of experiments/accuracy.py's MODELS with a plain
`tf.compat.v1.Session` (pinned thread pools, TensorFlow's BFC allocator far
above the step, the kernel path set explicitly), then traces one more step
with `RunOptions(trace_level=FULL_TRACE)`.  Its step statistics carry every
op's allocation records, in BFC *chunk* bytes, with their times, and each
output's requested bytes.  From them it prints:

* the measured peak and the chunks live at that moment, by op, with the bytes
  each chunk was requested for (a chunk less than twice its request is handed
  out whole: tfmem/memory/allocator.py);
* the step's own allocation order (requests, in TensorFlow's order) replayed
  through tfmem's BFC model: whether the allocator model reproduces the peak
  when it is given the order the executor took;
* tfmem's two predicted figures for the one-partition plan (bytes requested;
  the simulator's allocations replayed in its own op order).

With `--partition-size`, the step runs through `TFMemSession` in that plan
instead, and the traced step's statistics are read per partition: what the
allocator held when each partition started (TensorFlow's bytes in use at its
first op, less that op's own) against the simulator's `device_before`, each
partition's measured peak against its two predicted figures, and the op at
the peak with the scratch it allocated.  A plan of several partitions that
measures more than the same model in one shows there where the bytes go.

It finds, for instance, the oneDNN conv net's missing bytes: the max pooling
gradient's scratch, which its forward op's workspace saves only in the same
partition (issue 10).
Nothing here is asserted: it prints what it measured.
"""

import argparse
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


def _records(metadata):
    """[(time, bytes (+ allocated, - freed), op, requested or None)] in time order."""
    events = []
    for device in metadata.step_stats.dev_stats:
        for node in device.node_stats:
            outputs = [o.tensor_description.allocation_description for o in node.output]
            matched = 0
            for memory in node.memory:
                for record in memory.allocation_records:
                    requested = None
                    if record.alloc_bytes > 0 and matched < len(outputs) and \
                            outputs[matched].allocated_bytes == record.alloc_bytes:
                        requested = outputs[matched].requested_bytes
                        matched += 1
                    events.append((record.alloc_micros, record.alloc_bytes, node.node_name,
                                   requested))
    events.sort(key=lambda e: e[0])
    return events


def _live_at_peak(events):
    current, peak, at_peak, live = 0, 0, {}, {}
    requested = {}
    for _, nbytes, name, request in events:
        current += nbytes
        live[name] = live.get(name, 0) + nbytes
        if nbytes > 0 and request is not None:
            requested[name] = requested.get(name, 0) + request
        if current > peak:
            peak, at_peak = current, dict(live)
    return peak, {n: b for n, b in at_peak.items() if b}, requested


def _replay(events, state_bytes, steps=3):
    """The step's own request order through tfmem's BFC model: the last step's peak."""
    from tfmem.memory.allocator import BFCModel  # pylint: disable=import-outside-toplevel
    model = BFCModel()
    for nbytes in state_bytes:
        model.allocate(nbytes)
    peak = 0
    for _ in range(steps):
        handles, base = {}, model.in_use
        model.peak = model.in_use
        for _, nbytes, name, request in events:
            if nbytes > 0:
                handles.setdefault(name, []).append(
                    (nbytes, model.allocate(request if request is not None else nbytes)))
            else:
                held = handles.get(name, [])
                index = next((i for i, (b, _) in enumerate(held) if b == -nbytes), None)
                if index is not None:
                    model.free(held.pop(index)[1])
        for held in handles.values():  # the fetched outputs: freed once the run returns
            for _, handle in held:
                model.free(handle)
        peak = model.peak - base
    return peak


def worker(name, steps):
    # pylint: disable=import-outside-toplevel
    from tensorflow.core.protobuf import config_pb2
    import tfmem
    import accuracy
    from tfmem.plan.analyse import tensor_bytes
    from tfmem.run import accelerator

    builder, kwargs, batch = accuracy.MODELS[name]
    model, sess = accuracy.model_session(builder, kwargs)
    sess.run(model.init)
    feed = model.feed(batch)
    fetches = [model.train, model.loss]
    for _ in range(steps):
        sess.run(fetches, feed)
    start = accelerator.device_memory("CPU:0")["current"]
    accelerator.reset_peak("CPU:0")
    metadata = config_pb2.RunMetadata()
    sess.run(fetches, feed, run_metadata=metadata,
             options=config_pb2.RunOptions(trace_level=config_pb2.RunOptions.FULL_TRACE))
    measured = accelerator.device_memory("CPU:0")["peak"] - start
    events = _records(metadata)
    peak, live, requested = _live_at_peak(events)
    tfs = tfmem.TFMemSession(sess, partition_size=100000)
    trace = tfs.simulate(fetches, feed)
    sources = tfs.plan(fetches, feed).view.sources.values()
    tfs.close()
    variables = [n.state_bytes for n in sources if n.state_bytes]
    # The constants' small buffers too, as the simulator lays out its state.
    constants = [tensor_bytes(n.outputs[0].dtype, n.outputs[0].shape) or 0
                 for n in sources if n.type == "Const"]
    return dict(model=name, measured=measured, records_peak=peak,
                live_at_peak={n: [b, requested.get(n)] for n, b in live.items()},
                replayed_in_tensorflows_order=_replay(events, variables),
                replayed_with_constants=_replay(events, variables + [c for c in constants if c]),
                predicted=trace.peak_device - trace.state_bytes,
                predicted_chunks=trace.peak_device_chunks - trace.state_bytes)


def _partition_of(node_name):
    """The partition index of a copy named `tfmem/plan<k>/p<i>[_in|_out]/...`, or None."""
    match = re.search(r"/p(\d+)(?:_in|_out)?/", node_name)
    return int(match.group(1)) if match else None


def partitions_worker(name, steps, size):
    """Per partition of the plan at `size`: measured and predicted bytes (see the docstring)."""
    # pylint: disable=import-outside-toplevel
    from tensorflow.core.protobuf import config_pb2
    import accuracy
    from tfmem.run import accelerator

    builder, kwargs, batch = accuracy.MODELS[name]
    model, sess, tfs, feed, fetches = accuracy.measured_session(builder, kwargs, batch, size)
    trace = tfs.simulate(fetches, feed)
    for _ in range(steps):
        tfs.run(fetches, feed)
    measured = list(tfs.last_step.partition_peak_bytes)
    # What the allocator holds beyond the request's state (earlier sessions' leftovers).
    foreign = accelerator.device_memory("CPU:0")["current"] - trace.state_bytes
    metadata = config_pb2.RunMetadata()
    tfs.run(fetches, feed, run_metadata=metadata,
            options=config_pb2.RunOptions(trace_level=config_pb2.RunOptions.FULL_TRACE))
    first, top = {}, {}
    for device in metadata.step_stats.dev_stats:
        for node in device.node_stats:
            index = _partition_of(node.node_name)
            for memory in node.memory:
                if index is None or not memory.allocator_bytes_in_use:
                    continue
                before = memory.allocator_bytes_in_use - memory.live_bytes
                if index not in first or node.all_start_micros < first[index][0]:
                    first[index] = (node.all_start_micros, before)
                at_peak = before + memory.peak_bytes
                if at_peak > top.get(index, (0,))[0]:
                    top[index] = (at_peak, node.node_name.split(f"/p{index}/", 1)[-1],
                                  memory.peak_bytes - memory.live_bytes)
    tfs.close()
    rows = []
    for p in trace.partitions:
        rows.append(dict(index=p.index, measured=measured[p.index] - foreign,
                         held_at_start=first.get(p.index, (0, foreign))[1] - foreign,
                         predicted_before=p.device_before, predicted=p.device_peak,
                         predicted_chunks=p.device_peak_chunks,
                         op_at_peak=top.get(p.index, (0, None, 0))[1],
                         its_scratch=top.get(p.index, (0, None, 0))[2]))
    return dict(model=name, partition_size=size, partitions=rows)


def _print_partitions(data):
    print(f"{data['model']}, partition size {data['partition_size']}: per partition of one "
          f"traced step (MiB, the request's state included)")
    print(f"{'part':>4} {'held at start':>13} {'predicted':>9}  {'peak':>7} "
          f"{'predicted':>9} {'in chunks':>9}  op at the peak (its scratch)")
    for row in data["partitions"]:
        print(f"{row['index']:>4} {row['held_at_start'] / MIB:>13.3f} "
              f"{row['predicted_before'] / MIB:>9.3f}  {row['measured'] / MIB:>7.3f} "
              f"{row['predicted'] / MIB:>9.3f} {row['predicted_chunks'] / MIB:>9.3f}  "
              f"{row['op_at_peak']} ({row['its_scratch'] / MIB:.3f})")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="pool", help="a name of accuracy.MODELS")
    parser.add_argument("--onednn", choices=("0", "1"), default="1")
    parser.add_argument("--steps", type=int, default=4, help="plain steps before the traced one")
    parser.add_argument("--partition-size", type=int, default=None,
                        help="trace a TFMemSession step of this plan, per partition")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        if args.partition_size:
            print(json.dumps(partitions_worker(args.model, args.steps, args.partition_size)))
        else:
            print(json.dumps(worker(args.model, args.steps)))
        return 0
    from tfmem.cli.child_env import child_env  # pylint: disable=import-outside-toplevel
    size = ["--partition-size", str(args.partition_size)] if args.partition_size else []
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "--model",
                           args.model, "--steps", str(args.steps)] + size,
                          env=child_env(onednn=args.onednn == "1"), capture_output=True,
                          text=True, timeout=900, check=False)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        return 1
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    if args.partition_size:
        _print_partitions(data)
        return 0
    print(f"{data['model']}, oneDNN {'on' if args.onednn == '1' else 'off'}, one traced plain "
          f"step (bytes above what was allocated when it started):")
    print(f"  TensorFlow's peak                          {data['measured'] / MIB:7.3f} MiB")
    print(f"  allocation records' peak (chunks)          {data['records_peak'] / MIB:7.3f} MiB")
    print(f"  the records' order replayed (BFC model)    "
          f"{data['replayed_in_tensorflows_order'] / MIB:7.3f} MiB after the variables, "
          f"{data['replayed_with_constants'] / MIB:.3f} MiB after the variables and constants")
    print(f"  tfmem, requested (simulator's order)       {data['predicted'] / MIB:7.3f} MiB")
    print(f"  tfmem, in chunks (simulator's order)       {data['predicted_chunks'] / MIB:7.3f} MiB")
    print("  chunks live at the peak (op: chunk bytes, requested for its outputs):")
    for name, (chunk, request) in sorted(data["live_at_peak"].items(), key=lambda x: -x[1][0]):
        if chunk >= 1024:
            print(f"    {name:60} {chunk / MIB:7.3f} MiB"
                  + (f" for {request / MIB:7.3f} MiB" if request else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
