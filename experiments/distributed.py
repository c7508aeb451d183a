"""Between-graph replication with tfmem: one parameter server, two workers, capped devices.

    python experiments/distributed.py                 # the three runs below, ~2-4 min here
    python experiments/distributed.py --residence     # where a kept tensor should wait
    python experiments/distributed.py --keys          # per-step staging keys vs constant ones

Every task is a separate process on this machine: the ps is a plain
TensorFlow server, and each worker runs its own server and its own training
loop against it (`tf.compat.v1.Session(server.target)`, the usual
between-graph setup), with the variables on the ps through
`replica_device_setter`.  Servers use free ports of 127.0.0.1; every process
has a lifetime and is killed when the script ends, whatever happens.

TensorFlow's servers listen on every interface (GrpcServer hard-codes
0.0.0.0), so the script first moves itself into a private network namespace
whose only interface is loopback (local_cluster.enter_private_network: user
and network namespaces, no root needed where unprivileged user namespaces are
allowed), and every task it starts inherits it.  Where that is impossible it
stops with the reason; `--allow-all-interfaces` runs the cluster on the
machine's network instead, reachable from outside while it runs.

Updates are synchronous through a barrier made of TensorFlow ops on the ps
(SyncReplicasOptimizer lets a fast worker take a slow one's token, so its
losses depend on timing): each worker stores its gradients in its own slot
variables and signals a queue; the chief waits for every signal, applies the
mean of the slots (summed in a fixed order) and releases each worker through
a queue of its own.  Every worker thus sees the same parameters at step k in
every run, and the losses of two runs can be compared step by step.

Three runs, each a fresh cluster:

1. plain TensorFlow, uncapped (a BFC allocator with a high limit, for figures):
   the reference losses and each worker's device peak;
2. plain TensorFlow with each worker's allocator capped at half that peak:
   expected to run out of memory;
3. tfmem (TFMemSession, partition_size="auto" from the cap) at the same cap:
   expected to train, with the losses of run 1.

It prints, per worker, throughput and what limited it, and a RESULT line.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: import from the root

from experiments.local_cluster import (LocalCluster, NoPrivateNetwork, enter_private_network,  # noqa: E402  pylint: disable=wrong-import-position
                           exit_when_orphaned_or_after, in_private_network)

MIB = 1 << 20
UNCAPPED_MIB = 16384  # a BFC allocator this large never limits, but keeps figures
LOSS_RTOL = 1e-4
RESULT = "TFMEM-WORKER-RESULT"


# --------------------------------------------------------------------------
# the model and the barrier (built identically by every worker)


def mlp(tf, rng, args):
    """The experiment's model in the current graph and device scope: (input, weights, loss)."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    tf1 = tf.compat.v1
    x = tf1.placeholder(tf.float32, [args.batch, args.width], name="x")
    h, weights = x, []
    for i in range(args.depth):
        weights.append(tf1.get_variable(
            f"w{i}", initializer=(rng.randn(args.width, args.width)
                                  / np.sqrt(args.width)).astype(np.float32),
            use_resource=True))
        h = tf.tanh(h @ weights[-1])
    return x, weights, tf.reduce_mean(tf.square(h - 0.25))


def build(tf, spec, task, args):
    """The worker's training graph: an MLP, gradients into slots, the barrier."""
    tf1 = tf.compat.v1
    import numpy as np  # pylint: disable=import-outside-toplevel
    workers = len(spec["worker"])
    graph = tf.Graph()
    rng = np.random.RandomState(0)
    with graph.as_default():
        with graph.device(tf1.train.replica_device_setter(
                worker_device=f"/job:worker/task:{task}", cluster=spec)):
            x, weights, loss = mlp(tf, rng, args)
            grads = tf.gradients(loss, weights)
            slots = [[tf1.get_variable(f"slot{j}_{i}", shape=w.shape, trainable=False,
                                       initializer=tf1.zeros_initializer(), use_resource=True)
                      for i, w in enumerate(weights)] for j in range(workers)]
        with graph.device("/job:ps/task:0"):
            done = tf1.FIFOQueue(2 * workers, tf.int32, shapes=[], shared_name="done")
            go = [tf1.FIFOQueue(2, tf.int32, shapes=[], shared_name=f"go{j}")
                  for j in range(workers)]
            push = tf.group(*[s.assign(g) for s, g in zip(slots[task], grads)])
            with tf.control_dependencies([push]):
                signal = done.enqueue(task)
            if task == 0:
                with tf.control_dependencies([signal]):
                    arrived = done.dequeue_many(workers)
                with tf.control_dependencies([arrived]):
                    update = tf.group(*[
                        w.assign_sub(args.lr * tf.add_n([slots[j][i] for j in range(workers)])
                                     / workers) for i, w in enumerate(weights)])
                with tf.control_dependencies([update]):
                    train = tf.group(*[go[j].enqueue(0) for j in range(1, workers)])
            else:
                with tf.control_dependencies([signal]):
                    train = go[task].dequeue().op
        init = tf1.global_variables_initializer()
        uninitialized = tf1.report_uninitialized_variables()
    return graph, x, loss, train, init, uninitialized


def batch_for(task, step, args):
    import numpy as np  # pylint: disable=import-outside-toplevel
    return np.random.RandomState(1000 * task + step).randn(
        args.batch, args.width).astype(np.float32)


# --------------------------------------------------------------------------
# one worker process


def _first_line(err):
    for line in str(err).splitlines():
        if "OOM" in line or "out of memory" in line.lower() or "Exhausted" in line:
            return line.strip()[:200]
    return str(err).strip().splitlines()[0][:200]


def worker_main(args):
    exit_when_orphaned_or_after(args.lifetime)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tfmem  # pylint: disable=import-outside-toplevel
    tf1 = tf.compat.v1
    spec = json.loads(args.cluster)
    server = tf.distribute.Server(tf.train.ClusterSpec(spec), job_name="worker",
                                  task_index=args.task, protocol="grpc")
    graph, x, loss, train, init, uninitialized = build(tf, spec, args.task, args)
    sess = tf1.Session(server.target, graph=graph, config=tf1.ConfigProto(
        intra_op_parallelism_threads=1, inter_op_parallelism_threads=2,
        operation_timeout_in_ms=int(args.step_timeout * 1000)))
    report = {"task": args.task, "system": args.system, "cap_mib": args.cap,
              "losses": [], "step_times": [], "status": "ok"}
    try:
        if args.task == 0:
            sess.run(init)
        else:
            deadline = time.monotonic() + args.step_timeout
            while len(sess.run(uninitialized)) and time.monotonic() < deadline:
                time.sleep(0.2)
        runner = sess
        if args.system == "tfmem":
            runner = tfmem.TFMemSession(sess, partition_size="auto")
        for step in range(args.steps):
            tf.config.experimental.reset_memory_stats("CPU:0")
            started = time.perf_counter()
            _, value = runner.run([train, loss], {x: batch_for(args.task, step, args)})
            report["step_times"].append(time.perf_counter() - started)
            report["losses"].append(float(value))
            peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
            report["peak_bytes"] = max(report.get("peak_bytes", 0), peak)
            if args.system == "tfmem":
                stats = runner.last_step
                report.update(partitions=stats.partitions,
                              swap_bytes=stats.swapped_out_bytes + stats.swapped_in_bytes,
                              prefetch_wait=stats.prefetch_wait_time)
    except tf.errors.ResourceExhaustedError as err:
        report.update(status="oom", error=_first_line(err))
    except Exception as err:  # pylint: disable=broad-except
        report.update(status="error", error=f"{type(err).__name__}: {_first_line(err)}")
    print(RESULT, json.dumps(report), flush=True)
    os._exit(0)  # pylint: disable=protected-access  # the in-process server cannot be stopped


# --------------------------------------------------------------------------
# the driver


def run_cluster(system, cap_mib, args):
    """Start a ps and two workers; return the workers' reports (None for a lost one)."""
    env = {"TF_ENABLE_ONEDNN_OPTS": "0", "TF_CPP_MIN_LOG_LEVEL": "2"}
    with LocalCluster({"ps": 1, "worker": args.workers}, lifetime=args.time_limit,
                      env=dict(os.environ, **env),
                      allow_all_interfaces=args.allow_all_interfaces) as cluster:
        cluster.start_server("ps", 0)
        worker_env = {"TF_CPU_ALLOCATOR_USE_BFC": "true",
                      "TF_CPU_BFC_MEM_LIMIT_IN_MB": str(cap_mib)}
        procs = []
        for task in range(args.workers):
            command = [sys.executable, os.path.abspath(__file__), "--role", "worker",
                       "--task", str(task), "--cluster", json.dumps(cluster.spec),
                       "--system", system, "--cap", str(cap_mib),
                       "--lifetime", str(args.time_limit)] + model_args(args)
            if args.allow_all_interfaces:
                command.append("--allow-all-interfaces")
            procs.append(cluster.run_task("worker", task, command, worker_env,
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                          text=True))
        reports = []
        deadline = time.monotonic() + args.time_limit
        for task, proc in enumerate(procs):
            try:
                out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                cluster.stop()
                out = ""
            found = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines()
                     if line.startswith(RESULT)]
            reports.append(found[0] if found else {
                "task": task, "system": system, "cap_mib": cap_mib, "losses": [],
                "step_times": [], "status": "crash" if proc.returncode else "timeout",
                "error": f"exit code {proc.returncode}"})
    return reports


def model_args(args):
    return ["--steps", str(args.steps), "--batch", str(args.batch), "--width", str(args.width),
            "--depth", str(args.depth), "--lr", str(args.lr),
            "--step-timeout", str(args.step_timeout)]


def throughput(report, batch):
    times = report["step_times"][1:] or report["step_times"]
    return batch * len(times) / sum(times) if times else 0.0


def limit_of(report, reference):
    if report["status"] == "oom":
        return f"device memory: {report['error']}"
    if report["status"] != "ok":
        return f"{report['status']}: {report.get('error', '')}"
    if report["system"] == "tfmem":
        return (f"{report['partitions']} Session calls per step and "
                f"{report['swap_bytes'] / MIB:.1f} MiB of swap traffic per step "
                f"(prefetch wait {report['prefetch_wait'] * 1e3:.0f} ms), peak "
                f"{report['peak_bytes'] / MIB:.1f} of {report['cap_mib']} MiB")
    return (f"compute and the barrier (nothing else: peak "
            f"{report['peak_bytes'] / MIB:.1f} MiB{'' if reference else ' under the cap'})")


def losses_match(report, reference):
    if report["status"] != "ok" or len(report["losses"]) != len(reference["losses"]):
        return False
    return all(abs(a - b) <= LOSS_RTOL * max(abs(b), 1e-12)
               for a, b in zip(report["losses"], reference["losses"]))


def driver(args):
    started = time.monotonic()
    print(f"model: MLP depth {args.depth}, width {args.width}, batch {args.batch} per worker; "
          f"{args.workers} workers, 1 ps; {args.steps} synchronous steps", flush=True)
    reference = run_cluster("tf", UNCAPPED_MIB, args)
    if any(r["status"] != "ok" for r in reference):
        print("the uncapped plain run failed:", reference)
        return 1
    peak_mib = max(r["peak_bytes"] for r in reference) / MIB
    cap = max(int(peak_mib / 2), 1)
    print(f"plain step peak {peak_mib:.1f} MiB per worker -> cap {cap} MiB", flush=True)
    plain = run_cluster("tf", cap, args)
    ours = run_cluster("tfmem", cap, args)

    rows = [("TensorFlow, uncapped", reference), (f"TensorFlow, cap {cap} MiB", plain),
            (f"tfmem, cap {cap} MiB", ours)]
    print()
    print("| system | worker | status | samples/s | losses = uncapped | what limited it |")
    print("|---|---|---|---|---|---|")
    for label, reports in rows:
        for report, ref in zip(reports, reference):
            match = "reference" if reports is reference else (
                "yes" if losses_match(report, ref) else "no")
            print(f"| {label} | {report['task']} | {report['status']} | "
                  f"{throughput(report, args.batch):.0f} | {match} | "
                  f"{limit_of(report, reports is reference)} |")
    ok = (all(r["status"] == "oom" for r in plain)
          and all(losses_match(r, ref) for r, ref in zip(ours, reference)))
    ratio = (sum(throughput(r, args.batch) for r in ours)
             / max(sum(throughput(r, args.batch) for r in reference), 1e-9))
    print(f"\nRESULT {'ok' if ok else 'FAILED'}: plain workers "
          f"{'ran out of memory' if all(r['status'] == 'oom' for r in plain) else 'did not all fail'}"
          f" at {cap} MiB; tfmem {'trained with the uncapped losses' if ok else 'did not match'}"
          f" at {ratio:.2f}x the uncapped throughput ({time.monotonic() - started:.0f} s)")
    return 0 if ok else 1


# --------------------------------------------------------------------------
# where should a kept tensor wait? (residence measurement)


def residence_main(args):
    """Time producing a tensor on the device, keeping it, and reading it in a second
    Session call: session handle (local session), staging on the worker, and fetching
    to the client and feeding it back (both on a distributed session)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tensorflow.core.protobuf import config_pb2  # pylint: disable=import-outside-toplevel
    from tfmem import tf_private  # pylint: disable=import-outside-toplevel
    tf1 = tf.compat.v1
    # An in-process server: this process ends with the script (servers cannot be stopped).
    server = tf.distribute.Server.create_local_server()

    def build(kind, n):
        graph = tf.Graph()
        with graph.as_default():
            x = tf1.placeholder(tf.float32, [])  # the tensor is made on the device
            y = tf.fill([n], x) * 2.0
            if kind == "handle":
                ticket = tf.raw_ops.GetSessionHandle(value=y)
                holder = tf1.placeholder(tf.string, [])
                out = tf.reduce_sum(tf.raw_ops.GetSessionTensor(handle=holder, dtype=tf.float32))
                with tf.control_dependencies([out.op]):
                    free = [tf.raw_ops.DeleteSessionTensor(handle=holder).name]
            elif kind.startswith("staging"):
                key = tf.constant(1, tf.int64)
                if kind == "staging per step":  # a fed base plus the copy's offset
                    base = tf1.placeholder(tf.int64, [])
                    key = base + key
                stage = tf.raw_ops.MapStage(key=key, indices=[0], values=[y], dtypes=[tf.float32],
                                            shared_name="bench")
                with tf.control_dependencies([stage]):
                    ticket = tf.identity(key)
                holder = tf1.placeholder(tf.int64, [])
                out = tf.reduce_sum(tf.raw_ops.MapUnstage(
                    key=holder, indices=[0], dtypes=[tf.float32], shared_name="bench")[0])
                free = []
            else:  # fetch to the client, feed back
                ticket = y
                holder = tf1.placeholder(tf.float32, [n])
                out = tf.reduce_sum(tf.raw_ops.DeepCopy(x=holder))
                free = []
        produce_feeds = [x.name] + ([base.name] if kind == "staging per step" else [])
        return graph, (config_pb2.CallableOptions(feed=produce_feeds, fetch=[ticket.name]),
                       config_pb2.CallableOptions(feed=[holder.name], fetch=[out.name],
                                                  target=free))

    print("| tensor | session handle (local) | staging on the worker, constant key | "
          "staging, per-step key | fetch to client + feed |")
    print("|---|---|---|---|---|")
    for mib in args.sizes:
        n = mib * MIB // 4
        seed = np.float32(1.0)
        cells = []
        for kind, target in (("handle", ""), ("staging", server.target),
                             ("staging per step", server.target), ("client", server.target)):
            graph, (produce_opts, consume_opts) = build(kind, n)
            with tf1.Session(target, graph=graph) as sess:
                produce = tf_private.make_callable(sess, produce_opts)
                consume = tf_private.make_callable(sess, consume_opts)
                times = []
                for i in range(args.repeats + 2):
                    start = time.perf_counter()
                    ticket = produce(*([seed, np.int64(i << 20)] if kind == "staging per step"
                                       else [seed]))[0]
                    consume(np.array(ticket) if kind == "client" else ticket)
                    if i >= 2:
                        times.append(time.perf_counter() - start)
                cells.append(sorted(times)[len(times) // 2] * 1e3)
        print(f"| {mib} MiB | " + " | ".join(f"{c:.1f} ms" for c in cells) + " |", flush=True)
    os._exit(0)  # pylint: disable=protected-access


# --------------------------------------------------------------------------
# what per-step staging keys cost (keys measurement)

BASELINE_REVISION = "2d64030"  # the last commit whose staging keys were constants of a plan
KEYS_RESULT = "TFMEM-KEYS-RESULT"


def keys_client(args):
    """One client of a one-worker-one-ps cluster: steps/s of plain TensorFlow and of tfmem
    (whichever tfmem PYTHONPATH gives) on one plan, from 1 and from 2 threads."""
    exit_when_orphaned_or_after(args.lifetime)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import threading  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tfmem  # pylint: disable=import-outside-toplevel
    tf1 = tf.compat.v1
    spec = json.loads(args.cluster)
    graph = tf.Graph()
    rng = np.random.RandomState(0)
    with graph.as_default(), graph.device(tf1.train.replica_device_setter(
            worker_device="/job:worker/task:0", cluster=spec)):
        x, weights, loss = mlp(tf, rng, args)
        fetches = [loss, tf.gradients(loss, weights)]  # no updates: threads may overlap
        init = tf1.global_variables_initializer()
    sess = tf1.Session(f"grpc://{spec['worker'][0]}", graph=graph, config=tf1.ConfigProto(
        operation_timeout_in_ms=int(args.step_timeout * 1000)))
    sess.run(init)
    batch = rng.randn(args.batch, args.width).astype(np.float32)

    def rate(runner, threads):
        for _ in range(2):
            runner.run(fetches, {x: batch})  # warm: planned, compiled, caches filled
        def work():
            for _ in range(args.steps):
                runner.run(fetches, {x: batch})
        started = time.perf_counter()
        pool = [threading.Thread(target=work) for _ in range(threads)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
        return threads * args.steps / (time.perf_counter() - started)

    report = {"tfmem": os.path.dirname(tfmem.__file__), "plain": {}, "tfmem_rates": {},
              "ratios": {}}
    for swap in ("none", "all"):
        tfs = tfmem.TFMemSession(sess, partition_size=args.partition_size, swap=swap,
                                 swap_distance=1, options=tfmem.Options(swap_min_bytes=0))
        tfs.run(fetches, {x: batch})
        report[f"partitions_{swap}"] = tfs.last_step.partitions
        report[f"staged_{swap}"] = tfs.last_step.peak_device_handles
        for threads in (1, 2):
            # Plain and tfmem alternate, so that the machine's load weighs on both alike.
            pairs = [(rate(sess, threads), rate(tfs, threads)) for _ in range(args.repeats)]
            key = f"{swap}/{threads}"
            report["plain"][key] = float(np.median([p for p, _ in pairs]))
            report["tfmem_rates"][key] = float(np.median([t for _, t in pairs]))
            report["ratios"][key] = float(np.median([t / p for p, t in pairs]))
    print(KEYS_RESULT, json.dumps(report), flush=True)
    os._exit(0)  # pylint: disable=protected-access


def _baseline_tree(revision, into):
    """The tfmem package at `revision` of this repository, extracted under `into`."""
    repo = Path(__file__).resolve().parent.parent
    archive = subprocess.run(["git", "-C", str(repo), "archive", revision, "tfmem"],
                             check=True, capture_output=True, timeout=60).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True, timeout=60)
    return into


def keys_main(args):
    """Per-step staging keys (this tree) against constant keys (BASELINE_REVISION), each
    arm a client process of its own on one fresh one-worker-one-ps cluster."""
    import tempfile  # pylint: disable=import-outside-toplevel
    here = Path(__file__).resolve().parent
    runs = []
    with tempfile.TemporaryDirectory(prefix="tfmem-keys-") as old, \
            LocalCluster({"ps": 1, "worker": 1}, lifetime=args.time_limit,
                         env=dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0",
                                  TF_CPP_MIN_LOG_LEVEL="2"),
                         allow_all_interfaces=args.allow_all_interfaces) as cluster:
        cluster.start_servers()
        arms = ((f"constant keys ({args.baseline})", _baseline_tree(args.baseline, old)),
                ("per-step keys (this tree)", str(here.parent)))
        for label, path in arms * args.rounds:  # the arms alternate
            command = [sys.executable, os.path.abspath(__file__), "--role", "keys-client",
                       "--cluster", json.dumps(cluster.spec), "--lifetime",
                       str(args.time_limit), "--steps", str(args.steps), "--batch",
                       str(args.batch), "--width", str(args.width), "--depth",
                       str(args.depth), "--partition-size", str(args.partition_size),
                       "--repeats", str(args.repeats), "--step-timeout", str(args.step_timeout)]
            env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2",
                       PYTHONPATH=os.pathsep.join([path, str(here)]))
            out = subprocess.run(command, env=env, capture_output=True, text=True,
                                 timeout=args.time_limit, check=False).stdout
            found = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines()
                     if line.startswith(KEYS_RESULT)]
            if not found:
                print(f"the {label} client failed:\n{out[-4000:]}")
                return 1
            runs.append((label, found[0]))
    first = runs[0][1]
    print(f"MLP depth {args.depth}, width {args.width}, batch {args.batch}; fetches loss and "
          f"gradients (no updates); partition_size={args.partition_size}: "
          f"{first['partitions_none']} partitions; {args.steps} steps per thread, medians of "
          f"{args.repeats} alternations of plain and tfmem; {args.rounds} client(s) per arm")
    print("| tfmem | swap | threads | plain TF steps/s | tfmem steps/s | tfmem / plain |")
    print("|---|---|---|---|---|---|")
    for label, report in runs:
        for key, value in report["tfmem_rates"].items():
            swap, threads = key.split("/")
            print(f"| {label} | {swap} ({report[f'staged_{swap}']} staged at most) | "
                  f"{threads} | {report['plain'][key]:.1f} | {value:.1f} | "
                  f"{report['ratios'][key]:.2f} |")
    for key in first["ratios"]:
        ratio = {label: [r["ratios"][key] for name, r in runs if name == label]
                 for label, _ in arms}
        old_ratio, new_ratio = (statistics.median(v) for v in ratio.values())
        print(f"RESULT swap={key.split('/')[0]} threads={key.split('/')[1]}: tfmem/plain "
              f"{old_ratio:.2f} with constant keys, {new_ratio:.2f} with per-step keys "
              f"(per-step / constant = {new_ratio / old_ratio:.2f})")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--role", choices=["driver", "worker", "keys-client"], default="driver")
    parser.add_argument("--residence", action="store_true",
                        help="measure where a kept tensor should wait, then exit")
    parser.add_argument("--keys", action="store_true",
                        help="measure per-step staging keys against constant ones, then exit")
    parser.add_argument("--baseline", default=BASELINE_REVISION,
                        help="the revision whose tfmem stages at constant keys (--keys)")
    parser.add_argument("--partition-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2,
                        help="client processes per arm, alternating (--keys)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--time-limit", type=float, default=600,
                        help="seconds each cluster may live")
    parser.add_argument("--step-timeout", type=float, default=300)
    parser.add_argument("--task", type=int, default=0)
    parser.add_argument("--cluster")
    parser.add_argument("--system", choices=["tf", "tfmem"], default="tf")
    parser.add_argument("--cap", type=int, default=UNCAPPED_MIB)
    parser.add_argument("--lifetime", type=float, default=600)
    parser.add_argument("--allow-all-interfaces", action="store_true",
                        help="run without a private network namespace: the servers then "
                             "listen on every interface of this machine while they run")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    if args.role in ("worker", "keys-client") and not (args.allow_all_interfaces
                                                       or in_private_network()):
        print("error: a worker starts its own server, which would listen on every "
              "interface here: start workers from the driver", file=sys.stderr)
        return 2
    if args.role == "driver":  # workers inherit the driver's namespace
        if args.allow_all_interfaces:
            print("warning: --allow-all-interfaces: the servers listen on every interface "
                  "of this machine while the experiment runs", file=sys.stderr)
        else:
            try:
                enter_private_network()  # before TensorFlow starts any thread
            except NoPrivateNetwork as err:
                print(f"error: {err}\nThe servers would listen on every interface of this "
                      "machine. Pass --allow-all-interfaces to run there anyway.",
                      file=sys.stderr)
                return 2
    if args.role == "keys-client":
        return keys_client(args)
    if args.residence:
        return residence_main(args)
    if args.keys:
        return keys_main(args)
    if args.role == "worker":
        return worker_main(args)
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
