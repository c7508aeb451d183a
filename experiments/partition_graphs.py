"""A session graph per partition: does it make a partition's callable independent of
the whole graph, and what does a step cost then?  (issue 12)

DirectSession builds every callable from the whole session graph (it copies and
prunes it under `graph_state_lock_`), so tfmem's per-partition compile cost
grows with everything the session graph holds.  The one way around it that
keeps Session callables is a session whose graph holds only one partition.
Variables must then be shared between sessions, which TensorFlow's gRPC runtime
does: on one server, sessions created with `ConfigProto.isolate_session_state`
False (the default) use the worker's shared devices and so one resource
manager (session_mgr.cc: the legacy worker session; TensorFlow's own
server_lib_test `testIsolateSessionState` checks that one session sees
another's variable), and tfmem's staging areas (`WorkerStaging`, MapStage with a
shared_name) carry kept tensors from one call to the next.

Measured here, on one in-process server (127.0.0.1, in a private network
namespace: GrpcServer listens on every interface; the process, and with it
the server, ends after `--time-limit` s at the latest), for session graphs
of about 2k, 10k and 50k ops (tools/bench.py's filler chain beside the bench's
MLP training step, layers 16, width 64, batch 32), tfmem at partition_size 50:

  local:      today: TFMemSession over a local DirectSession (tfmem config);
              a callable is built from the whole session graph;
  per-graph:  TFMemSession over a gRPC session whose graph is never sent to
              the master; every callable tfmem asks for is made on a new gRPC
              session of its own, whose graph holds only what that callable
              reaches (its partition's ops, the variable handles it reads, the
              placeholders it is fed), cut from the Python graph at its feeds;
              variables and staged tensors are shared through the server;
  grpc:       today's distributed path: TFMemSession over one gRPC session of
              the whole graph (its master builds each callable from it).

The gRPC arms keep their variables in containers of their own: sessions of one
server share every variable of the same name.  Per arm: the first step split by
`TFMemSession.last_compile`, and the making of each callable timed around the
call, wall and process CPU time (for per-graph: cutting its graph, importing
it, creating its session, making the callable); then `--steps` steps
alternating the arms and plain (one `Session.run` of the same step on a local
session), medians.  Correctness: every arm's losses against plain's, bit for
bit, and a tiny case: a variable updated through one partition-session is read
by another, a tensor staged in one is unstaged in another.

    TF_ENABLE_ONEDNN_OPTS=0 python experiments/partition_graphs.py \
        --out experiments/results/partition_graphs.json
"""

import argparse
import itertools
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

from local_cluster import (NoPrivateNetwork, enter_private_network,  # noqa: E402
                           exit_when_orphaned_or_after, free_port)


# --------------------------------------------------------------------------
# a partition's own graph


def reached_graph_def(graph, options):
    """The GraphDef of what a callable with `options` (CallableOptions) reaches in `graph`.

    Walks inputs and control inputs back from the fetches and targets, stopping at
    fed tensors (which must be placeholders: they keep their names, so the same
    options work on the cut graph).  Colocation hints naming ops left out are dropped.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    fed = set(options.feed)
    names = [n.split(":")[0] for n in options.fetch] + list(options.target)
    names += [n.split(":")[0] for n in fed]
    keep, stack = {}, list(names)
    while stack:
        name = stack.pop()
        if name in keep:
            continue
        op = graph.get_operation_by_name(name)
        keep[name] = op
        if op.type == "Placeholder":
            continue
        for tensor in op.inputs:
            if tensor.name in fed and tensor.op.type != "Placeholder":
                raise ValueError(f"{tensor.name} is fed but not a placeholder: a cut graph "
                                 "cannot keep its name")
            stack.append(tensor.op.name)
        stack.extend(c.name for c in op.control_inputs)
    graph_def = tf.compat.v1.GraphDef()
    graph_def.versions.CopyFrom(graph.graph_def_versions)
    for op in keep.values():  # any order: the session sorts the graph
        node = graph_def.node.add()
        node.CopyFrom(op.node_def)
        if "_class" in node.attr:
            hints = [h for h in node.attr["_class"].list.s
                     if h.decode().split("@", 1)[-1] in keep]
            del node.attr["_class"].list.s[:]
            node.attr["_class"].list.s.extend(hints)
    return graph_def


class PartitionSessions:
    """Makes every callable on a gRPC session of its own holding only what it reaches."""

    def __init__(self, target, config):
        self.target = target
        self.config = config
        self.sessions = []
        self.made = []  # per callable: ops in its graph, seconds (cut, import, session, make)

    def make_callable(self, session, options):
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        graph = session.graph
        c0, t0 = time.process_time(), time.perf_counter()
        graph_def = reached_graph_def(graph, options)
        t1 = time.perf_counter()
        own = tf.Graph()
        with own.as_default():
            tf.graph_util.import_graph_def(graph_def, name="")
        t2 = time.perf_counter()
        sess = tf.compat.v1.Session(self.target, graph=own, config=self.config)
        self.sessions.append(sess)
        t3 = time.perf_counter()
        call = _ORIGINAL[0](sess, options)
        t4 = time.perf_counter()
        self.made.append(dict(ops=len(graph_def.node), cut_s=t1 - t0, import_s=t2 - t1,
                              session_s=t3 - t2, make_s=t4 - t3, wall_s=t4 - t0,
                              cpu_s=time.process_time() - c0))
        return call

    def close(self):
        for sess in self.sessions:
            sess.close()
        self.sessions = []


class TimedCallables:
    """Makes callables as tfmem does (on the session itself), timing each: wall and the
    process's CPU time (less sensitive than wall time to a machine shared with others)."""

    def __init__(self):
        self.made = []

    def make_callable(self, session, options):
        c0, t0 = time.process_time(), time.perf_counter()
        call = _ORIGINAL[0](session, options)
        self.made.append(dict(wall_s=time.perf_counter() - t0, cpu_s=time.process_time() - c0))
        return call

    def close(self):
        pass


_ROUTERS = {}  # id(session) -> PartitionSessions or TimedCallables
_ORIGINAL = []  # tfmem.tf_private.make_callable as imported


def route_callables(router, session):
    """Make tfmem's callables of `session` through `router` (this experiment only:
    tfmem.tf_private.make_callable is wrapped while the script runs)."""
    from tfmem import tf_private  # pylint: disable=import-outside-toplevel
    if not _ORIGINAL:
        _ORIGINAL.append(tf_private.make_callable)

        def make_callable(sess, options):
            router_of = _ROUTERS.get(id(sess))
            if router_of is not None:
                return router_of.make_callable(sess, options)
            return _ORIGINAL[0](sess, options)
        tf_private.make_callable = make_callable
    _ROUTERS[id(session)] = router


def unroute(session):
    _ROUTERS.pop(id(session), None)


# --------------------------------------------------------------------------
# the graphs


def config(tf, timeout_ms=None):
    import tfmem  # pylint: disable=import-outside-toplevel
    out = tfmem.session_config(tf.compat.v1.ConfigProto(
        intra_op_parallelism_threads=1, inter_op_parallelism_threads=2,
        isolate_session_state=False))
    if timeout_ms:
        out.operation_timeout_in_ms = timeout_ms
    return out


def build(tf, target_ops, layers, seed=0):
    """The bench's MLP step in a session graph filled to ~target_ops ops."""
    import bench  # pylint: disable=import-outside-toplevel
    from tfmem.cli import models  # pylint: disable=import-outside-toplevel
    model = models.mlp(layers=layers, width=64, features=64, seed=seed)
    filler = target_ops - model.graph.version
    if filler > 0:
        with model.graph.as_default():
            tf.graph_util.import_graph_def(bench.chain_graph_def(filler), name="filler")
    return model


def in_container(tf, model, container):
    """`model`'s graph again, its variables in `container` of the server's resource
    manager: arms on one server must not train each other's variables (sessions with
    isolate_session_state False share every variable of the same name)."""
    graph_def = model.graph.as_graph_def()
    for node in graph_def.node:
        if node.op == "VarHandleOp":
            node.attr["container"].s = container.encode()
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    return argparse.Namespace(
        graph=graph, init=graph.get_operation_by_name(model.init.name),
        train=graph.get_operation_by_name(model.train.name),
        loss=graph.get_tensor_by_name(model.loss.name),
        feed=lambda batch: {graph.get_tensor_by_name(t.name): v
                            for t, v in model.feed(batch).items()})


def tiny_check(tf, target, cfg):
    """A variable assigned through one session's own graph is read by another; a tensor
    staged by one is unstaged by another.  Returns a dict of what was seen."""
    tf1 = tf.compat.v1

    def session(build_fn):
        graph = tf.Graph()
        with graph.as_default():
            out = build_fn()
        return tf1.Session(target, graph=graph, config=cfg), out

    def handle():
        return tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[2], shared_name="tiny_v")

    init_sess, init = session(lambda: tf.raw_ops.AssignVariableOp(
        resource=handle(), value=tf.constant([1.0, 2.0])))
    add_sess, add = session(lambda: tf.raw_ops.AssignAddVariableOp(
        resource=handle(), value=tf.constant([10.0, 20.0])))
    read_sess, read = session(lambda: tf.raw_ops.ReadVariableOp(resource=handle(),
                                                                 dtype=tf.float32))
    stage_sess, stage = session(lambda: tf.raw_ops.MapStage(
        key=tf.constant(7, tf.int64), indices=[0], values=[tf.constant([3.0, 4.0])],
        dtypes=[tf.float32], shared_name="tiny_area"))
    unstage_sess, unstage = session(lambda: tf.raw_ops.MapUnstage(
        key=tf.constant(7, tf.int64), indices=[0], dtypes=[tf.float32],
        shared_name="tiny_area")[0])
    try:
        init_sess.run(init)
        add_sess.run(add)
        seen = read_sess.run(read).tolist()
        stage_sess.run(stage)
        unstaged = unstage_sess.run(unstage).tolist()
    finally:
        for sess in (init_sess, add_sess, read_sess, stage_sess, unstage_sess):
            sess.close()
    return dict(variable_read=seen, variable_expected=[11.0, 22.0],
                staged_read=unstaged, staged_expected=[3.0, 4.0],
                ok=seen == [11.0, 22.0] and unstaged == [3.0, 4.0])


# --------------------------------------------------------------------------
# one measurement


def _compile_row(tfs, first_s):
    c = tfs.last_compile
    return dict(first_step_s=first_s, first_run_s=tfs.last_step.wall_time,
                plan_s=c.plan_time, rewrite_s=c.rewrite_time, extend_s=c.extend_time,
                callables_s=c.callables_time, callables=c.callables,
                ms_per_callable=c.callables_time / max(c.callables, 1) * 1e3,
                session_graph_ops=c.graph_ops_before, added_ops=c.graph_ops_after - c.graph_ops_before)


ARMS = ("local", "per-graph", "grpc")
_CONTAINERS = itertools.count()


def measure(tf, target, target_ops, args, first_arm):
    """The three arms on fresh graphs of ~target_ops ops; compile, then steps alternating."""
    import tfmem  # pylint: disable=import-outside-toplevel
    tf1 = tf.compat.v1
    cfg = config(tf)
    grpc_cfg = config(tf, timeout_ms=int(args.call_timeout * 1000))
    arms = {}
    names = list(ARMS)
    start = names.index(first_arm)
    for arm in names[start:] + names[:start]:
        model = build(tf, target_ops, args.layers)
        if arm != "local":
            model = in_container(tf, model, f"{arm}_{next(_CONTAINERS)}")
        feed = model.feed(args.batch)
        fetches = [model.train, model.loss]
        if arm == "local":
            sess = tf1.Session(graph=model.graph, config=cfg)
            sess.run(model.init)
            router = TimedCallables()
        elif arm == "grpc":  # today's distributed path: one gRPC session, the whole graph
            sess = tf1.Session(target, graph=model.graph, config=grpc_cfg)
            sess.run(model.init)
            router = TimedCallables()
        else:
            sess = tf1.Session(target, graph=model.graph, config=grpc_cfg)
            # the whole graph is never sent: a run on this session itself would fail
            sess._extend_graph = lambda: None  # pylint: disable=protected-access
            router = PartitionSessions(target, grpc_cfg)
            from tensorflow.core.protobuf import config_pb2  # pylint: disable=import-outside-toplevel
            init = router.make_callable(sess, config_pb2.CallableOptions(
                target=[model.init.name]))
            init()
            router.made = []
        route_callables(router, sess)
        tfs = tfmem.TFMemSession(sess, partition_size=args.partition_size)
        started = time.perf_counter()
        _, loss = tfs.run(fetches, feed)
        row = _compile_row(tfs, time.perf_counter() - started)
        row["losses"] = [float(loss)]
        made = router.made
        row["ms_make_wall"] = statistics.median(m["wall_s"] for m in made) * 1e3
        row["ms_make_cpu"] = statistics.median(m["cpu_s"] for m in made) * 1e3
        if arm == "per-graph":
            row["own_graph_ops"] = [m["ops"] for m in made]
            row["ms_own_total"] = statistics.median(
                m["cut_s"] + m["import_s"] + m["session_s"] + m["make_s"] for m in made) * 1e3
            for part in ("cut_s", "import_s", "session_s", "make_s"):
                row[f"ms_{part[:-2]}"] = statistics.median(m[part] for m in made) * 1e3
        arms[arm] = dict(tfs=tfs, sess=sess, router=router, model=model, feed=feed,
                         fetches=fetches, row=row)
    # plain: one Session.run of the same step on a local session of the local arm's graph
    local = arms["local"]
    plain = tf1.Session(graph=local["model"].graph, config=cfg)
    plain.run(local["model"].init)
    plain_losses = [float(plain.run(local["fetches"], local["feed"])[1])]
    times = {name: [] for name in ARMS + ("plain",)}
    order = list(ARMS) + ["plain"]
    for step in range(args.steps):
        for which in (order if step % 2 == 0 else order[::-1]):
            started = time.perf_counter()
            if which == "plain":
                plain_losses.append(float(plain.run(local["fetches"], local["feed"])[1]))
            else:
                arm = arms[which]
                _, loss = arm["tfs"].run(arm["fetches"], arm["feed"])
                arm["row"]["losses"].append(float(loss))
            times[which].append(time.perf_counter() - started)
    out = dict(graph_ops=target_ops, first=first_arm,
               plain_step_ms=statistics.median(times["plain"]) * 1e3, plain_losses=plain_losses)
    for name, arm in arms.items():
        row = arm["row"]
        row["step_ms"] = statistics.median(times[name]) * 1e3
        row["losses_equal_plain"] = row["losses"] == plain_losses
        out[name] = row
        arm["tfs"].close()
        unroute(arm["sess"])
        arm["router"].close()
        arm["sess"].close()
    plain.close()
    return out


# --------------------------------------------------------------------------
# summary


def summarize(rows, graphs):
    """Medians per graph size and the ratios the issue asks about."""
    table = []
    for target in graphs:
        mine = [r for r in rows if r["graph_ops"] == target]
        if not mine:
            continue

        def med(arm, key):
            return statistics.median(r[arm][key] for r in mine)
        table.append(dict(
            graph_ops=target, repeats=len(mine),
            session_graph_ops=med("local", "session_graph_ops"),
            callables=med("local", "callables"),
            local_ms_per_callable=med("local", "ms_per_callable"),
            per_graph_ms_per_callable=med("per-graph", "ms_per_callable"),
            per_graph_ms_own_total=med("per-graph", "ms_own_total"),
            **{f"{arm.replace('-', '_')}_make_{kind}": med(arm, f"ms_make_{kind}")
               for arm in ARMS for kind in ("wall", "cpu")},
            grpc_ms_per_callable=med("grpc", "ms_per_callable"),
            grpc_first_step_s=med("grpc", "first_step_s"),
            grpc_extend_s=med("grpc", "extend_s"), grpc_step_ms=med("grpc", "step_ms"),
            per_graph_own_ops=statistics.median(
                statistics.median(r["per-graph"]["own_graph_ops"]) for r in mine),
            per_graph_ms_session=med("per-graph", "ms_session"),
            per_graph_ms_make=med("per-graph", "ms_make"),
            per_graph_ms_cut=med("per-graph", "ms_cut") + med("per-graph", "ms_import"),
            local_rewrite_s=med("local", "rewrite_s"), per_graph_rewrite_s=med("per-graph", "rewrite_s"),
            local_extend_s=med("local", "extend_s"), per_graph_extend_s=med("per-graph", "extend_s"),
            local_first_step_s=med("local", "first_step_s"),
            per_graph_first_step_s=med("per-graph", "first_step_s"),
            local_first_run_s=med("local", "first_run_s"),
            per_graph_first_run_s=med("per-graph", "first_run_s"),
            plain_step_ms=statistics.median(r["plain_step_ms"] for r in mine),
            local_step_ms=med("local", "step_ms"), per_graph_step_ms=med("per-graph", "step_ms"),
            step_ratio=statistics.median(r["per-graph"]["step_ms"] / r["local"]["step_ms"]
                                         for r in mine),
            losses_equal_plain=all(r[a]["losses_equal_plain"] for r in mine
                                   for a in ARMS),
            load_average=[r["load_average"][0] for r in mine]))
    goals = {}
    if len(table) > 1:
        low, high = table[0], table[-1]
        for arm in ("local", "grpc", "per_graph"):
            for kind in ("wall", "cpu"):
                goals[f"{arm}_make_{kind}_ratio_{high['graph_ops'] // 1000}k_"
                      f"{low['graph_ops'] // 1000}k"] = \
                    high[f"{arm}_make_{kind}"] / low[f"{arm}_make_{kind}"]
    return table, goals


def markdown(data, provenance_text):
    """The docs/results.md table of a result file (tools/results_tables.py renders it)."""
    args = data["args"]
    lines = [
        f"`python experiments/partition_graphs.py --graphs {' '.join(map(str, args['graphs']))} "
        f"--repeats {args['repeats']} --steps {args['steps']} --out "
        f"experiments/results/partition_graphs.json` (bench MLP step, {args['layers']} layers, "
        f"batch {args['batch']}, partition_size {args['partition_size']}; one in-process "
        f"server; medians of {args['repeats']} interleaved repeats; "
        f"{provenance_text}):", "",
        "| session graph ops | callables | making a callable, ms wall (CPU): local / one gRPC "
        "session / own graph | ops in an own graph | first step s: local / one gRPC / own "
        "graphs (its rewrite: local / own) | step ms: plain / local / one gRPC / own graphs | "
        "own graphs / local step | losses bit-equal plain | load (1 min) |",
        "|---|---|---|---|---|---|---|---|---|"]
    for r in data["table"]:
        making = " / ".join(f"{r[f'{arm}_make_wall']:.0f} ({r[f'{arm}_make_cpu']:.0f})"
                            for arm in ("local", "grpc", "per_graph"))
        lines.append(
            f"| {r['session_graph_ops']:.0f} | {r['callables']:.0f} | {making} | "
            f"{r['per_graph_own_ops']:.0f} | "
            f"{r['local_first_step_s']:.2f} / {r['grpc_first_step_s']:.2f} / "
            f"{r['per_graph_first_step_s']:.2f} ({r['local_rewrite_s']:.2f} / "
            f"{r['per_graph_rewrite_s']:.2f}) | {r['plain_step_ms']:.1f} / "
            f"{r['local_step_ms']:.1f} / {r['grpc_step_ms']:.1f} / {r['per_graph_step_ms']:.1f} | "
            f"{r['step_ratio']:.2f} | {'yes' if r['losses_equal_plain'] else 'NO'} | "
            f"{'-'.join(f'{v:.1f}' for v in (min(r['load_average']), max(r['load_average'])))} |")
    lines.append("")
    for name, value in data["goals"].items():
        lines.append(f"    {name}={value:.2f} (goal <= 1.5) {'ok' if value <= 1.5 else 'MISSED'}")
    tiny = data["tiny_check"]
    lines += ["", f"Shared state across partition-sessions (tiny case): variable read "
              f"{tiny['variable_read']} (expected {tiny['variable_expected']}), staged tensor "
              f"read {tiny['staged_read']} (expected {tiny['staged_expected']}): "
              f"{'ok' if tiny['ok'] else 'FAILED'}.", ""]
    return "\n".join(lines)


def result(args, tiny, rows, started, complete):
    """The result file's dict (written to --out when given)."""
    from tfmem.cli import provenance  # pylint: disable=import-outside-toplevel
    table, goals = summarize(rows, args.graphs)
    info = provenance.provenance(f"oneDNN {'on' if args.onednn == '1' else 'off'}")
    data = dict(kind="partition-graphs", complete=complete, args=vars(args), tiny_check=tiny,
                rows=rows, table=table, goals=goals, seconds=time.monotonic() - started,
                provenance=info)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=1)
    return data


def dict_args(args, **changes):
    return argparse.Namespace(**{**vars(args), **changes})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--graphs", type=int, nargs="+", default=[2000, 10_000, 50_000])
    parser.add_argument("--partition-size", type=int, default=50)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="skip the discarded first measurement (tests)")
    parser.add_argument("--onednn", choices=["0", "1"], default="0")
    parser.add_argument("--time-limit", type=float, default=1800,
                        help="seconds this process (and its server) may live")
    parser.add_argument("--call-timeout", type=float, default=120,
                        help="operation_timeout_in_ms of the gRPC sessions, in seconds")
    parser.add_argument("--out", help="write the results (JSON) here")
    parser.add_argument("--allow-all-interfaces", action="store_true",
                        help="run without a private network namespace (the server then "
                             "listens on every interface while the script runs)")
    args = parser.parse_args(argv)
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = args.onednn
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if not args.allow_all_interfaces:
        try:
            enter_private_network()  # before TensorFlow starts any thread
        except NoPrivateNetwork as err:
            print(f"error: {err}\nPass --allow-all-interfaces to run anyway.", file=sys.stderr)
            return 2
    exit_when_orphaned_or_after(args.time_limit)  # the in-process server cannot be stopped
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    started = time.monotonic()
    port = free_port()
    server = tf.distribute.Server(
        tf.train.ClusterSpec({"worker": [f"127.0.0.1:{port}"]}), job_name="worker",
        task_index=0, config=config(tf))
    target = server.target
    tiny = tiny_check(tf, target, config(tf, int(args.call_timeout * 1000)))
    print(f"tiny check (shared variables and staging across sessions): {tiny}", flush=True)
    if args.warmup:  # discarded: the process's first gRPC sessions and callables cost extra
        measure(tf, target, min(args.graphs), dict_args(args, steps=2), "per-graph")
    rows = []
    for repeat in range(args.repeats):
        graphs = args.graphs[repeat % len(args.graphs):] + args.graphs[:repeat % len(args.graphs)]
        for i, target_ops in enumerate(graphs):
            first = ARMS[(repeat + i) % len(ARMS)]
            row = measure(tf, target, target_ops, args, first)
            row["repeat"] = repeat
            row["load_average"] = list(os.getloadavg())
            rows.append(row)
            result(args, tiny, rows, started, complete=False)  # what is measured so far
            print(f"[{time.monotonic() - started:6.0f} s] repeat {repeat}, {target_ops} ops "
                  f"(load {row['load_average'][0]:.1f}): making a callable, ms wall (CPU): "
                  + ", ".join(f"{a} {row[a]['ms_make_wall']:.1f} ({row[a]['ms_make_cpu']:.1f})"
                              for a in ARMS)
                  + "; step ms plain " + f"{row['plain_step_ms']:.1f}, "
                  + ", ".join(f"{a} {row[a]['step_ms']:.1f}" for a in ARMS)
                  + "; losses equal plain: "
                  + "/".join(str(row[a]['losses_equal_plain']) for a in ARMS),
                  flush=True)
    data = result(args, tiny, rows, started, complete=True)
    from tfmem.cli import provenance  # pylint: disable=import-outside-toplevel
    print(markdown(data, provenance.describe(data["provenance"])))
    return 0 if tiny["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
