"""How fast a request is refused before anything runs: a budget nothing fits, and
swapped tensors the host cannot hold."""

import time

from tools.bench_sections.shared import tensorflow


def run(huge=100_000):
    """Seconds until a request is refused before anything runs: a budget nothing fits
    (BudgetError, while planning), and swapped tensors the host cannot hold
    (HostMemoryError, before the first partition).  In this process, no cap needed."""
    tf = tensorflow()
    tf1 = tf.compat.v1
    import tfmem  # pylint: disable=import-outside-toplevel
    from tfmem.cli import models  # pylint: disable=import-outside-toplevel
    result = {}
    model = models.mlp(layers=12)
    with tf1.Session(graph=model.graph) as sess:
        tfs = tfmem.TFMemSession(sess, device_memory_budget="4MiB")
        sess.run(model.init)
        started = time.perf_counter()
        try:
            tfs.run([model.train, model.loss], model.feed(1024))
            result["budget_refusal"] = None
        except tfmem.BudgetError:
            result["budget_refusal"] = time.perf_counter() - started
    graph = tf.Graph()
    with graph.as_default():
        a = tf.ones([huge, huge])  # 40 GB of float32: a static shape, never materialised
        b = tf.add(a, 1.0)
        total = tf.reduce_sum(tf.add(tf.add(tf.cos(tf.sin(b)), a), b))
    with tf1.Session(graph=graph) as sess:
        tfs = tfmem.TFMemSession(sess, partition_size=1, swap="all")
        started = time.perf_counter()
        try:
            tfs.run(total)
            result["host_guard_refusal"] = None
        except tfmem.HostMemoryError:
            result["host_guard_refusal"] = time.perf_counter() - started
    return result


def report(refusals, out=print):
    """The refusals line."""
    out("\nrefused before running: "
        + ", ".join(f"{key.replace('_', ' ')} "
                    + ("not refused" if value is None else f"after {value:.2f} s")
                    for key, value in refusals.items()))


def targets(refusals):
    """{name: value}: seconds until each refusal."""
    values = {}
    for key in ("budget_refusal", "host_guard_refusal"):
        values[f"{key}_s"] = refusals[key] if refusals[key] is not None else "not refused"
    return values
