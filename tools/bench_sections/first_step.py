"""(c) The first step of one fixed request against the size of the session graph:
planning, prediction, rewrite, extend and callables, per config and partition size."""

import time

import tfmem

from tools.bench_sections.planning import chain_graph_def
from tools.bench_sections.shared import session, tensorflow


def run(graph_ops=(2000, 10_000, 50_000), partition_sizes=(20, 50, 200),
                     configs=("tfmem", "default"), default_sizes=None, layers=16, batch=32,
                     partial_runs=False, log=None):
    """tfmem's first step of one fixed request, in session graphs of growing size.

    The request is an MLP training step (`models.mlp(layers, width=64)`); the
    user's graph is filled up to `graph_ops` with a chain graph the request
    does not touch.  Per config and size: plain's first step of the request on
    a fresh session with that config, then tfmem's, split by
    `TFMemSession.last_compile`.  "tfmem": one `tfmem.Session` per partition
    size (its config, and a session graph holding only what requests reach);
    "default": one TFMemSession per partition size wrapping one session of
    TensorFlow's default config on the user's graph (each plan's copies add to
    that graph: the row says its size at compile time).  `default_sizes`: the
    partition sizes run with the default config (None: all).
    """
    log = log or (lambda text: None)
    tf = tensorflow()
    from tfmem.cli import models  # pylint: disable=import-outside-toplevel
    rows = []
    for config in configs:
        sizes = partition_sizes if config == "tfmem" or default_sizes is None else default_sizes
        for target in graph_ops:
            model = models.mlp(layers=layers, width=64, features=64)
            filler = target - model.graph.version
            if filler > 0:
                with model.graph.as_default():
                    tf.graph_util.import_graph_def(chain_graph_def(filler), name="filler")
            feed = model.feed(batch)
            fetches = [model.train, model.loss]
            plain = session(tf, model.graph, config)
            plain.run(model.init)
            started = time.perf_counter()
            plain.run(fetches, feed)
            plain_first_s = time.perf_counter() - started
            plain.close()
            own = config == "tfmem"  # tfmem.Session per size, else one session wrapped by all
            if not own:
                wrapped = session(tf, model.graph, config)
                wrapped.run(model.init)
            for size in sizes:
                if own:  # a session of its own, on a copy of what it reaches
                    tfs = tfmem.Session(graph=model.graph, partition_size=size,
                                        options=tfmem.Options(partial_runs=partial_runs))
                    tfs.run(model.init)
                else:  # the user's session, wrapped: its graph is the whole user graph
                    tfs = tfmem.TFMemSession(wrapped, partition_size=size,
                                             options=tfmem.Options(partial_runs=partial_runs))
                started = time.perf_counter()
                tfs.run(fetches, feed)
                first_s = time.perf_counter() - started
                c = tfs.last_compile
                plan = tfs.plan(fetches, feed)
                parts = len(plan.partitions)
                row = dict(config=config, graph_ops=target, user_graph_ops=model.graph.version,
                           session_graph_ops=c.graph_ops_before,
                           added_ops=c.graph_ops_after - c.graph_ops_before,
                           request_ops=plan.num_ops, partition_size=size,
                           partitions=parts, callables=c.callables, copy_s=c.copy_time,
                           plan_s=c.plan_time,
                           simulate_s=c.simulate_time, rewrite_s=c.rewrite_time,
                           extend_s=c.extend_time,
                           callables_s=c.callables_time,
                           ms_per_callable=c.callables_time / max(c.callables, 1) * 1e3,
                           # a partial run's one executor, built by its first setup
                           setup_s=tfs.last_step.setup_time,
                           partial_run=tfs.last_step.partial_run,
                           # the first calls by name: TensorFlow building their
                           # executors, and running them
                           build_s=tfs.last_step.build_time,
                           ms_per_partition=(c.callables_time + tfs.last_step.setup_time
                                             + tfs.last_step.build_time)
                           / max(parts, 1) * 1e3,
                           first_run_s=tfs.last_step.wall_time, first_step_s=first_s,
                           plain_first_step_s=plain_first_s)
                rows.append(row)
                if own:
                    tfs.close()
                log(f"(c) {config} config, {c.graph_ops_before} ops in the session graph, "
                    f"partition_size={size}: {parts} partitions, {c.callables} callables "
                    f"{row['ms_per_callable']:.0f} ms each, setup {row['setup_s']:.2f} s, "
                    f"first step {first_s:.1f} s "
                    f"(plain {plain_first_s:.2f} s)")
            if not own:
                wrapped.close()
    return dict(layers=layers, batch=batch, rows=rows)


def targets(first):
    """{name: value}: per-partition compile cost (callables, and a partial run's setup,
    which builds one executor for all partitions) at the largest graph over the
    smallest, at ps 50."""
    values = {}
    for config in ("tfmem", "default"):
        rows = {r["graph_ops"]: r for r in first["rows"]
                if r["config"] == config and r["partition_size"] == 50}
        if len(rows) > 1:
            low, high = rows[min(rows)], rows[max(rows)]
            name = "compile_ratio" if config == "tfmem" else "compile_ratio_default_config"
            values[f"{name}_{high['graph_ops'] // 1000}k_{low['graph_ops'] // 1000}k"] = \
                high["ms_per_partition"] / low["ms_per_partition"]
    return values


def report(first, out=print):
    """The table of (c): where tfmem's first step goes, per session-graph size."""
    out(f"\n(c) first step vs session graph: MLP training step ({first['layers']} layers, "
        f"batch {first['batch']}) in a session graph filled with unrelated ops; seconds")
    out(f"{'config':>7} {'user':>6} {'graph':>6} {'ps':>4} {'parts':>5} {'calls':>5} {'copy':>5} "
        f"{'plan':>5} {'pred.':>5} "
        f"{'rewrite':>7} {'extend':>6} {'callab.':>7} {'setup':>6} {'build':>6} {'ms/part':>7} {'run':>5} {'first':>6} {'plain':>6} "
        f"{'+ops':>5}")
    for r in first["rows"]:
        out(f"{r['config']:>7} {r.get('user_graph_ops', r['session_graph_ops']):>6} "
            f"{r['session_graph_ops']:>6} {r['partition_size']:>4} "
            f"{r['partitions']:>5} {r.get('callables', r['partitions']):>5} "
            f"{r.get('copy_s', 0.0):>5.2f} {r['plan_s']:>5.2f} {r['simulate_s']:>5.2f} "
            f"{r['rewrite_s']:>7.2f} {r['extend_s']:>6.2f} {r['callables_s']:>7.2f} "
            f"{r.get('setup_s', 0.0):>6.2f} {r.get('build_s', 0.0):>6.2f} "
            f"{r.get('ms_per_partition', r['ms_per_callable']):>7.1f} "
            f"{r['first_run_s']:>5.2f} {r['first_step_s']:>6.2f} {r['plain_first_step_s']:>6.2f} "
            f"{r['added_ops']:>5}")
    out("  config tfmem: tfmem.Session (a session graph of what requests reach); default: "
        "a TFMemSession wrapping a default-config session on the user's graph")
    out("  user: ops in the user's graph; graph: ops in the session graph when the plan "
        "was compiled; ps: partition_size; "
        "calls: Session calls (one per stretch of partitions, see plan/stretches.py)")
    out("  copy: tfmem.Session copying the ops the request reaches into its session graph; "
        "plan / pred. / rewrite / extend / callab.: planning, memory prediction, copying the "
        "plan into the graph, TensorFlow taking in the grown graph, making the Session "
        "callables;")
    out("  setup: the first partial run's setup (one executor for every partition; 0 with "
        "calls); build: the first step's calls by name (TensorFlow building their executors, "
        "and running them); ms/part: (callab. + setup + build) / parts")
    out("  run: the first run of the partitions; first: tfs.run's first call in all; plain: "
        "plain Session.run's first call, same config; +ops: ops the plan's copies added")
