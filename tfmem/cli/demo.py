"""Side-by-side demo: train one small graph-mode MLP through a plain
``tf.compat.v1.Session`` and through :class:`tfmem.TFMemSession`.

Both sessions share one graph and start from the same initial values (the
initialisers are numpy constants), so every step must report the same loss.
The demo prints a per-step loss table, the number of partitions tfmem cut the
training request into, the largest loss difference and the median time per
step of both sessions.  With ``--device-memory MiB`` that part runs in a
subprocess whose TensorFlow allocator is capped at MiB (an emulated
accelerator, see :mod:`tfmem.run.placement.accelerator`) and also prints each session's
peak; a plain session that runs out of memory is reported, not fatal.

Then (unless ``--no-proof``) it runs the memory proof of :mod:`tfmem.cli.proof`:
a model whose plain training step needs about twice the memory tfmem needs,
trained under a cap of half the plain peak.

Run it with ``tfmem demo`` or ``python -m tfmem demo``; ``--help`` lists the
options.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

from tfmem.cli import child_env, proof
from tfmem.cli.arguments import positive_int

RTOL = 1e-4
ATOL = 1e-6

INPUT_DIM = 64
HIDDEN_DIMS = (128, 128, 128)
NUM_CLASSES = 10
NUM_EXAMPLES = 1024


# The demo's counts: (option, default, what it counts); each a positive whole number.
COUNTS = (("--steps", 20, "training steps per session"),
          ("--partition-size", 50, "max ops per partition for TFMemSession"),
          ("--batch-size", 64, "examples per step"))

# The demo's switches: (option, what it does).
SWITCHES = (("--no-proof", "skip the memory proof (plain vs tfmem under half the plain peak)"),
            ("--tf2", "also run the TensorFlow 2 memory proof (Keras fit through tfmem.keras "
                      "under half the plain peak; see tfmem.cli.proof_tf2)"))


def add_arguments(parser):
    """Add the demo's options to ``parser`` (shared with ``tfmem demo``)."""
    for option, default, counts in COUNTS:
        parser.add_argument(option, type=positive_int, default=default,
                            help=f"{counts} (default: {default})")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed for the synthetic data and the initial weights (default: 0)")
    parser.add_argument("--device-memory", type=positive_int, metavar="MiB",
                        help="run the side-by-side part in a subprocess with TensorFlow's "
                             "allocator capped at MiB (an emulated accelerator) and print "
                             "both sessions' peaks")
    for option, what in SWITCHES:
        parser.add_argument(option, action="store_true", help=what)
    # Set in the capped subprocess that --device-memory starts, and in the uncapped
    # plain reference it starts when the plain session runs out of memory there.
    parser.add_argument("--capped-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--reference-child", action="store_true", help=argparse.SUPPRESS)
    return parser


def _synthetic_data(np, seed):
    """A seeded classification task: labels from a random linear teacher."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((NUM_EXAMPLES, INPUT_DIM)).astype(np.float32)
    teacher = rng.standard_normal((INPUT_DIM, NUM_CLASSES)).astype(np.float32)
    y = np.argmax(x @ teacher, axis=1).astype(np.int64)
    return x, y


def _build_model(tf, np, seed):
    """A 4-layer MLP with a momentum-SGD train op, built in graph mode."""
    rng = np.random.default_rng(seed + 1)
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, INPUT_DIM], name="x")
        y = tf.compat.v1.placeholder(tf.int64, [None], name="y")
        h = x
        dims = (INPUT_DIM,) + HIDDEN_DIMS + (NUM_CLASSES,)
        for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:])):
            with tf.compat.v1.variable_scope(f"layer{i}"):
                w0 = (rng.standard_normal((d_in, d_out)) * np.sqrt(2.0 / d_in)).astype(np.float32)
                w = tf.compat.v1.Variable(w0, name="w", use_resource=True)
                b = tf.compat.v1.Variable(np.zeros(d_out, np.float32), name="b", use_resource=True)
                h = tf.matmul(h, w) + b
                if i < len(dims) - 2:
                    h = tf.nn.relu(h)
        loss = tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=h), name="loss")
        optimizer = tf.compat.v1.train.MomentumOptimizer(learning_rate=0.05, momentum=0.9)
        train_op = optimizer.minimize(loss)
        init = tf.compat.v1.global_variables_initializer()
    return graph, x, y, loss, train_op, init


class _Track:
    """One session's side of the side-by-side run: losses, times, peak, OOM."""

    def __init__(self):
        self.losses, self.times = [], []
        self.peak = 0
        self.oom_step = None  # the step that raised ResourceExhaustedError

    def step(self, tf, run, step, measure):
        """Run one step unless an earlier one ran out of memory; return the loss or None."""
        if self.oom_step is not None:
            return None
        if measure:
            tf.config.experimental.reset_memory_stats("CPU:0")
        started = time.perf_counter()
        try:
            value = float(run())
            elapsed = time.perf_counter() - started
        except tf.errors.ResourceExhaustedError:
            self.oom_step = step
            return None
        finally:
            if measure:
                self.peak = max(self.peak, tf.config.experimental.get_memory_info("CPU:0")["peak"])
        self.times.append(elapsed)
        self.losses.append(value)
        return value


def _side_by_side(args):
    """Train both sessions in this process and print the table; return the exit code."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    import tfmem  # pylint: disable=import-outside-toplevel

    capped = args.device_memory is not None
    data_x, data_y = _synthetic_data(np, args.seed)
    graph, x, y, loss, train_op, init = _build_model(tf, np, args.seed)

    def batch(step):
        start = (step * args.batch_size) % NUM_EXAMPLES
        idx = np.arange(start, start + args.batch_size) % NUM_EXAMPLES
        return {x: data_x[idx], y: data_y[idx]}

    def cell(value):
        return f"{'OOM':>12}" if value is None else f"{value:>12.6f}"

    plain_track, tfmem_track = _Track(), _Track()
    plain = tf.compat.v1.Session(graph=graph)
    with plain, tfmem.TFMemSession(tf.compat.v1.Session(graph=graph),
                                   partition_size=args.partition_size) as tfs:
        plain.run(init)
        tfs.run(init)
        plan = tfs.plan([train_op, loss], feed_dict=batch(0))

        print(f"tfmem demo: 4-layer MLP {INPUT_DIM}-{'-'.join(map(str, HIDDEN_DIMS))}-"
              f"{NUM_CLASSES}, batch {args.batch_size}, {args.steps} steps, "
              f"partition_size {args.partition_size}"
              + (f", device memory {args.device_memory} MiB (emulated)" if capped else ""))
        print(f"{'step':>4}  {'plain loss':>12}  {'tfmem loss':>12}  {'abs diff':>9}")
        for step in range(args.steps):
            feed = batch(step)
            plain_loss = plain_track.step(
                tf, lambda: plain.run([train_op, loss], feed_dict=feed)[1], step, capped)
            tfmem_loss = tfmem_track.step(
                tf, lambda: tfs.run([train_op, loss], feed_dict=feed)[1], step, capped)
            diff = ("-" if plain_loss is None or tfmem_loss is None
                    else f"{abs(plain_loss - tfmem_loss):.2e}")
            print(f"{step:>4}  {cell(plain_loss)}  {cell(tfmem_loss)}  {diff:>9}", flush=True)

    print(f"partitions in the train request: {len(plan.partitions)} "
          f"({len(plan.transfers)} tensors cross partitions)")
    if capped:
        def peak(track):
            if track.oom_step is not None:
                return f"ResourceExhaustedError at step {track.oom_step}"
            return f"{track.peak / proof.MIB:.2f} MiB"
        print(f"peak device memory (TF allocator, largest step) under {args.device_memory} MiB: "
              f"plain {peak(plain_track)}, tfmem {peak(tfmem_track)}")
    compared = min(len(plain_track.losses), len(tfmem_track.losses))
    plain_losses = np.array(plain_track.losses[:compared])
    tfmem_losses = np.array(tfmem_track.losses[:compared])
    if compared:
        print(f"max abs loss difference: {float(np.max(np.abs(plain_losses - tfmem_losses))):.3e}")
    if plain_track.times and tfmem_track.times:
        plain_ms = 1e3 * statistics.median(plain_track.times)
        tfmem_ms = 1e3 * statistics.median(tfmem_track.times)
        print(f"median time per step: plain {plain_ms:.2f} ms, tfmem {tfmem_ms:.2f} ms "
              f"({tfmem_ms / plain_ms:.2f}x)")

    if tfmem_track.oom_step is not None:
        print(f"TFMEM OUT OF MEMORY: TFMemSession raised ResourceExhaustedError at step "
              f"{tfmem_track.oom_step} under {args.device_memory} MiB")
        return 1
    if compared < args.steps:
        # The plain session ran out of memory under the cap: compare every tfmem loss
        # with a plain session's, trained without a cap in a fresh process.
        print(f"plain Session ran out of memory at step {plain_track.oom_step}; comparing "
              f"TFMemSession's {args.steps} losses with a plain Session trained without a cap "
              f"(fresh process) ...", flush=True)
        reference = _plain_reference(args)
        if isinstance(reference, str):
            print(f"NO REFERENCE: {reference}")
            return 1
        plain_losses, only = np.array(reference), " (plain: uncapped reference process)"
        tfmem_losses = np.array(tfmem_track.losses)
        print(f"max abs loss difference: "
              f"{float(np.max(np.abs(plain_losses - tfmem_losses))):.3e}")
    else:
        only = ""
    return _compare(np, plain_losses, tfmem_losses, only)


def _compare(np, plain_losses, tfmem_losses, note):
    """Print whether the losses match; the exit code."""
    if np.allclose(tfmem_losses, plain_losses, rtol=RTOL, atol=ATOL):
        print(f"losses match (rtol {RTOL:g}){note}")
        return 0
    bad = np.flatnonzero(~np.isclose(tfmem_losses, plain_losses, rtol=RTOL, atol=ATOL))
    print(f"LOSS MISMATCH: tfmem and plain losses differ beyond rtol {RTOL:g} "
          f"at step(s) {', '.join(map(str, bad.tolist()))} "
          f"(first: plain {plain_losses[bad[0]]:.6f}, tfmem {tfmem_losses[bad[0]]:.6f}){note}")
    return 1


REFERENCE = "DEMO-REFERENCE "


def _plain_reference_child(args):
    """Train only the plain session, without a cap, and print its losses as JSON."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import json  # pylint: disable=import-outside-toplevel

    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    data_x, data_y = _synthetic_data(np, args.seed)
    graph, x, y, loss, train_op, init = _build_model(tf, np, args.seed)
    losses = []
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(init)
        for step in range(args.steps):
            start = (step * args.batch_size) % NUM_EXAMPLES
            idx = np.arange(start, start + args.batch_size) % NUM_EXAMPLES
            losses.append(float(sess.run([train_op, loss],
                                         feed_dict={x: data_x[idx], y: data_y[idx]})[1]))
    print(REFERENCE + json.dumps(losses), flush=True)
    return 0


def _plain_reference(args):
    """Plain losses of every step from an uncapped fresh process, or a reason (str)."""
    import json  # pylint: disable=import-outside-toplevel
    cmd = [sys.executable, "-m", "tfmem.cli.demo", "--reference-child", "--no-proof",
           "--steps", str(args.steps), "--batch-size", str(args.batch_size),
           "--seed", str(args.seed)]
    # The same kernel path as this process; the allocator without a cap.
    env = child_env.child_env(onednn=child_env.onednn_from_env())
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(REFERENCE)]
    if proc.returncode != 0 or not lines:
        return (f"the uncapped plain reference process ended without losses "
                f"({child_env.describe_exit(proc.returncode)}): "
                + " | ".join(proc.stderr.strip().splitlines()[-3:]))
    return json.loads(lines[-1][len(REFERENCE):])


def _side_by_side_capped(args):
    """Run the side-by-side part in a fresh process under the --device-memory cap."""
    cmd = [sys.executable, "-m", "tfmem.cli.demo", "--capped-child", "--no-proof",
           "--device-memory", str(args.device_memory), "--steps", str(args.steps),
           "--partition-size", str(args.partition_size),
           "--batch-size", str(args.batch_size), "--seed", str(args.seed)]
    sys.stdout.flush()
    # TensorFlow 2.21's oneDNN kernels can crash the process (SIGSEGV) instead
    # of raising ResourceExhaustedError when the capped allocator is full
    # (seen in Relu); the standard kernels raise it.  So oneDNN is off here
    # unless TF_ENABLE_ONEDNN_OPTS asks for it.  Both sessions run in this one
    # process, so they still compare like with like.
    env = child_env.child_env(cap_mib=args.device_memory, onednn=child_env.onednn_from_env())
    code = subprocess.run(cmd, env=env, check=False).returncode
    if code < 0:
        print(f"the capped side-by-side process CRASHED ({child_env.describe_exit(code)}; "
              f"TensorFlow's log is on stderr): not an out-of-memory error")
        return 1
    return code


def _memory_proof(args):
    """Run and print the memory proof of tfmem.cli.proof; return the exit code."""
    d = proof.DEFAULTS
    print()
    print(f"memory proof: {d['layers']}-layer MLP, width {d['width']}, batch {d['batch']}, "
          f"{d['steps']} steps; TFMemSession partition_size {d['partition_size']}, "
          f"swap {d['swap']}; one fresh process per run")
    result = proof.run_proof(seed=args.seed,
                             progress=lambda text: print(f"  running: {text}", flush=True))
    proof.report(result)
    return 0 if result["ok"] else 1


def run(args):
    """Run the demo with parsed ``args``; return the exit code."""
    if args.reference_child:
        return _plain_reference_child(args)
    if args.device_memory is not None and not args.capped_child:
        code = _side_by_side_capped(args)
    else:
        if args.device_memory is not None:
            import tfmem  # pylint: disable=import-outside-toplevel
            tfmem.emulate_accelerator(args.device_memory)  # before TensorFlow is imported
        code = _side_by_side(args)
    ok = code == 0
    if not args.no_proof:
        ok = _memory_proof(args) == 0 and ok
    if getattr(args, "tf2", False):
        from tfmem.cli import proof_tf2  # pylint: disable=import-outside-toplevel
        ok = proof_tf2.demo_part() == 0 and ok
    return 0 if ok else 1


def main(argv=None):
    """Entry point of ``tfmem demo``: parse ``argv`` and run the demo."""
    parser = add_arguments(argparse.ArgumentParser(
        prog="tfmem demo",
        description="Train a small MLP through a plain Session and TFMemSession "
                    "side by side and compare losses and step times, then run the "
                    "memory proof."))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
