"""Planning a ~100k-op chain graph: the first `tfs.plan` and the cached second one.
The chain graph also fills session graphs in the first-step section."""

import time

import tfmem

from tools.bench_sections.shared import session, tensorflow


def chain_graph(n_ops=100_000, width=8):
    """A ~n_ops-op graph: forward chain, then a backward chain reading every activation.

    Per layer, forward: MatMul, Relu, Mul, AddV2; backward: Mul, ReluGrad,
    MatMul(transpose_b).  Built as one GraphDef and imported.  Returns
    (graph, x placeholder, loss tensor).
    """
    tf = tensorflow()
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(chain_graph_def(n_ops, width), name="")
    return graph, graph.get_tensor_by_name("x:0"), graph.get_tensor_by_name("loss:0")


def chain_graph_def(n_ops, width=8):
    """The GraphDef of `chain_graph` (about n_ops nodes)."""
    tf = tensorflow()
    import numpy as np  # pylint: disable=import-outside-toplevel
    tf1 = tf.compat.v1
    layers = max(1, (n_ops - 6) // 7)
    graph_def = tf1.GraphDef()
    dtype = tf1.AttrValue(type=tf.float32.as_datatype_enum)

    def node(name, op, inputs=(), **attrs):
        new = graph_def.node.add(name=name, op=op)
        new.input.extend(inputs)
        for key, value in attrs.items():
            new.attr[key].CopyFrom(value)

    def const(name, value):
        node(name, "Const", dtype=tf1.AttrValue(type=tf.as_dtype(value.dtype).as_datatype_enum),
             value=tf1.AttrValue(tensor=tf.make_tensor_proto(value)))

    node("x", "Placeholder", dtype=dtype,
         shape=tf1.AttrValue(shape=tf.TensorShape([None, width]).as_proto()))
    const("w", np.eye(width, dtype=np.float32) / 1.5)
    const("half", np.float32(0.5))
    const("axes", np.array([0, 1], dtype=np.int32))
    h, acts = "x", []
    for i in range(layers):
        node(f"f{i}/mm", "MatMul", [h, "w"], T=dtype)
        node(f"f{i}/relu", "Relu", [f"f{i}/mm"], T=dtype)
        node(f"f{i}/mul", "Mul", [f"f{i}/relu", "half"], T=dtype)
        node(f"f{i}/add", "AddV2", [f"f{i}/mul", f"f{i}/relu"], T=dtype)
        acts.append(f"f{i}/relu")
        h = f"f{i}/add"
    node("seed", "OnesLike", [h], T=dtype)
    grad = "seed"
    for i in reversed(range(layers)):
        node(f"b{i}/scale", "Mul", [grad, "half"], T=dtype)
        node(f"b{i}/relugrad", "ReluGrad", [f"b{i}/scale", acts[i]], T=dtype)
        node(f"b{i}/mm", "MatMul", [f"b{i}/relugrad", "w"], T=dtype,
             transpose_b=tf1.AttrValue(b=True))
        grad = f"b{i}/mm"
    node("loss", "Sum", [grad, "axes"], T=dtype,
         Tidx=tf1.AttrValue(type=tf.int32.as_datatype_enum))
    return graph_def


def run(n_ops=100_000, partition_size=200, log=None):
    """First and cached `tfs.plan` time on a chain graph of ~n_ops ops."""
    log = log or (lambda text: None)
    tf = tensorflow()
    import numpy as np  # pylint: disable=import-outside-toplevel
    started = time.perf_counter()
    graph, x, loss = chain_graph(n_ops)
    build_s = time.perf_counter() - started
    sess = session(tf, graph)
    tfs = tfmem.TFMemSession(sess, partition_size=partition_size)
    feed = {x: np.ones((4, 8), np.float32)}
    started = time.perf_counter()
    plan = tfs.plan(loss, feed)
    first_s = time.perf_counter() - started
    started = time.perf_counter()
    again = tfs.plan(loss, feed)
    cached_s = time.perf_counter() - started
    sess.close()
    result = dict(graph_ops=len(graph.get_operations()), request_ops=plan.num_ops,
                  build_s=build_s, partition_size=partition_size, plan_s=first_s,
                  cached_s=cached_s, cached_same_plan=again is plan,
                  partitions=len(plan.partitions), transfers=len(plan.transfers))
    log(f"(a) planning: {result['request_ops']} ops: first plan {first_s:.1f} s, "
        f"cached {cached_s * 1e3:.2f} ms")
    return result


def report(plan, out=print):
    """The planning line."""
    out(f"\n(a) planning: chain graph of {plan['graph_ops']} ops ({plan['request_ops']} in "
        f"the request, built in {plan['build_s']:.1f} s), partition_size "
        f"{plan['partition_size']}: first tfs.plan {plan['plan_s']:.2f} s -> "
        f"{plan['partitions']} partitions, {plan['transfers']} transfers; second call "
        f"{plan['cached_s'] * 1e3:.2f} ms (same plan object: {plan['cached_same_plan']})")


def targets(plan):
    """{name: value} of planning: first plan seconds, cached plan seconds."""
    values = {}
    values["plan_100k_s" if plan["request_ops"] >= 90_000 else
           f"plan_{plan['request_ops'] // 1000}k_s"] = plan["plan_s"]
    values["cached_plan_s"] = plan["cached_s"]
    return values
