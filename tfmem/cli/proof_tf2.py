"""Memory proof, TensorFlow 2 edition: Keras `model.fit` under a cap plain TF cannot meet.

Three runs of one activation-heavy Keras MLP, each in a fresh process (the
memory cap is read when TensorFlow starts, see :mod:`tfmem.run.placement.accelerator`):

    (a) plain fit, BFC allocator, no real cap      -> step peak P, reference losses
    (b) plain fit,   cap = P/2 MiB                 -> must raise ResourceExhaustedError
    (c) fit through tfmem.keras.partitioned, same cap -> must train, losses equal to (a)

tfmem runs in budget mode (partition_size="auto": the emulated cap is the
budget, the simulator picks the partition size).

The model is the Session proof's (:mod:`tfmem.cli.proof`) as Keras layers: per
layer ``h = relu(h @ w); h = sin(h) * 0.5 + h``, a mean-square loss against
zeros, plain SGD; batches come from a seeded `tf.data` pipeline that makes
each batch on demand, so the data set itself does not sit in device memory.
Every process runs with oneDNN off (``TF_ENABLE_ONEDNN_OPTS=0``: oneDNN has
crashed at a cap instead of raising) and one intra-op thread.  The peak is
TensorFlow's allocator peak per train step (reset at each batch's start).

``python -m tfmem.cli.proof_tf2 --system tf|tfmem [--device-memory MiB] --json``
runs one system in this process; without ``--system`` it runs the whole proof.
``tfmem demo --tf2`` runs it too.
"""

import argparse
import json
import os
import statistics
import sys
import time

import tfmem
from tfmem.cli import child_env
from tfmem.cli.proof import losses_match
from tfmem.memory.sizes import MIB, mib

RTOL = 1e-4
BASELINE_LIMIT_MIB = 16384  # BFC allocator (so TF keeps figures) with room to spare

DEFAULTS = dict(layers=24, batch=1024, width=256, seed=0, steps=5,
                partition_size="auto", swap="auto", prefetch=1)
SYSTEMS = ("tf", "tfmem")


def build_model(keras, layers, width, seed):
    """The proof MLP as a compiled Keras model (no XLA, SGD 0.01, mean-square loss)."""
    from keras import ops  # pylint: disable=import-outside-toplevel

    class SinResidual(keras.layers.Layer):
        """h -> sin(h) * 0.5 + h: keeps h and sin's input alive for the backward pass."""

        def call(self, inputs):
            return ops.sin(inputs) * 0.5 + inputs

    model = keras.Sequential([keras.Input((width,))])
    for i in range(layers):
        model.add(keras.layers.Dense(
            width, activation="relu", use_bias=False,
            kernel_initializer=keras.initializers.GlorotUniform(seed=seed + i)))
        model.add(SinResidual())
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=False)
    return model


def dataset(tf, steps, batch, width, seed):
    """`steps` batches (x, zeros), each made from a stateless seed when it is read."""
    def make(step):
        x = tf.random.stateless_normal([batch, width], seed=tf.stack([seed, step]))
        return x, tf.zeros([batch, width])
    return tf.data.Dataset.range(steps).map(make)


def _oom_line(error):
    for line in str(error).splitlines():
        if line.strip().startswith("OOM when allocating"):
            return "ResourceExhaustedError: " + line.strip().split(" on /job")[0]
    return "ResourceExhaustedError"


def train(system, steps=DEFAULTS["steps"], layers=DEFAULTS["layers"], batch=DEFAULTS["batch"],
          width=DEFAULTS["width"], seed=DEFAULTS["seed"], partition_size=DEFAULTS["partition_size"],
          swap=DEFAULTS["swap"], prefetch=DEFAULTS["prefetch"]):
    """Fit the proof model for `steps` batches in this process; return a dict.

    Keys: losses (the loss Keras reports after each batch: its running mean
    over the epoch), peak_bytes (largest per-step allocator peak), oom, error,
    step_times, step_time_median, last_step (tfmem's StepStats, as text) and
    the settings.
    """
    if system not in SYSTEMS:
        raise ValueError(f"system must be one of {SYSTEMS}, got {system!r}")
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import keras  # pylint: disable=import-outside-toplevel

    from tfmem.run.placement import accelerator  # pylint: disable=import-outside-toplevel

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    model = build_model(keras, layers, width, seed)
    if system == "tfmem":
        tfmem.keras.partitioned(model, partition_size=partition_size, swap=swap,
                                prefetch=prefetch)
    result = dict(system=system, device_memory_mib=accelerator.emulated_memory_mib(),
                  steps=steps, layers=layers, batch=batch, width=width, seed=seed,
                  partition_size=partition_size if system == "tfmem" else None,
                  swap=swap if system == "tfmem" else None,
                  losses=[], peak_bytes=0, oom=False, error=None, step_times=[],
                  step_time_median=None, last_step=None)

    class Measure(keras.callbacks.Callback):
        """Per train step: reset the allocator peak, then read it and the loss."""

        def on_train_batch_begin(self, batch, logs=None):
            accelerator.reset_peak("CPU:0")
            self.started = time.perf_counter()  # pylint: disable=attribute-defined-outside-init

        def on_train_batch_end(self, batch, logs=None):
            result["step_times"].append(time.perf_counter() - self.started)
            memory = accelerator.device_memory("CPU:0")
            if memory is not None:
                result["peak_bytes"] = max(result["peak_bytes"], memory["peak"])
            result["losses"].append(float(logs["loss"]))

    try:
        model.fit(dataset(tf, steps, batch, width, seed), epochs=1, verbose=0,
                  callbacks=[Measure()])
    except tf.errors.ResourceExhaustedError as err:
        result["oom"] = True
        result["error"] = _oom_line(err)
        memory = accelerator.device_memory("CPU:0")
        if memory is not None:
            result["peak_bytes"] = max(result["peak_bytes"], memory["peak"])
    if result["step_times"]:
        result["step_time_median"] = statistics.median(result["step_times"])
    step = tfmem.keras.train_step_of(model)
    if step is not None and step.last_step is not None:
        result["last_step"] = str(step.last_step)
        result["partitions"] = step.last_step.partitions
    return result


def _run_subprocess(system, device_memory, timeout=600, **settings):
    """`train` in a fresh `python -m tfmem.cli.proof_tf2` process: its dict, or one with `failed`."""
    cmd = [sys.executable, "-m", "tfmem.cli.proof_tf2", "--system", system, "--json",
           "--device-memory", str(device_memory)]
    for key, value in settings.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    started = time.perf_counter()
    result, proc, tail = child_env.run_json_child(
        cmd, child_env.self_capping_env(onednn=False), timeout)
    if result is None:
        return dict(system=system, device_memory_mib=device_memory, failed=True,
                    returncode=proc.returncode, stderr_tail=tail, command=cmd)
    result.update(failed=False, process_seconds=time.perf_counter() - started)
    return result


def run_proof(steps=DEFAULTS["steps"], layers=DEFAULTS["layers"], batch=DEFAULTS["batch"],
              width=DEFAULTS["width"], seed=DEFAULTS["seed"],
              partition_size=DEFAULTS["partition_size"], swap=DEFAULTS["swap"],
              prefetch=DEFAULTS["prefetch"], timeout=600, progress=None):
    """Run the three-process proof; return the runs and the verdict (`ok`)."""
    model = dict(steps=steps, layers=layers, batch=batch, width=width, seed=seed)
    settings = dict(partition_size=partition_size, swap=swap, prefetch=prefetch)
    say = progress or (lambda text: None)
    say("plain fit, no cap ...")
    plain = _run_subprocess("tf", BASELINE_LIMIT_MIB, timeout, **model)
    result = dict(plain=plain, cap_mib=None, plain_capped=None, tfmem_capped=None,
                  plain_oom=False, tfmem_fits=False, losses_match=False, max_rel_diff=None,
                  ok=False)
    if plain["failed"] or plain["oom"] or not plain["peak_bytes"]:
        return result
    cap = result["cap_mib"] = plain["peak_bytes"] // 2 // MIB
    say(f"plain fit, cap {cap} MiB ...")
    result["plain_capped"] = _run_subprocess("tf", cap, timeout, **model)
    say(f"fit through tfmem.keras, cap {cap} MiB ...")
    tfmem_run = result["tfmem_capped"] = _run_subprocess("tfmem", cap, timeout, **model,
                                                         **settings)
    result["plain_oom"] = not result["plain_capped"]["failed"] and result["plain_capped"]["oom"]
    result["tfmem_fits"] = (not tfmem_run["failed"] and not tfmem_run["oom"]
                            and 0 < tfmem_run["peak_bytes"] <= cap * MIB)
    if not tfmem_run["failed"]:
        expected, got = plain["losses"], tfmem_run["losses"]
        result["losses_match"] = losses_match(expected, got, rtol=RTOL)
        if expected and len(got) == len(expected):
            result["max_rel_diff"] = max(abs(g - e) / max(abs(e), 1e-30)
                                         for e, g in zip(expected, got))
    result["ok"] = result["plain_oom"] and result["tfmem_fits"] and result["losses_match"]
    return result


def _ms(seconds):
    return "n/a" if seconds is None else f"{seconds * 1e3:.0f} ms"


def report(result, out=print):
    """Print a `run_proof` result, one fact per line."""
    plain = result["plain"]
    if plain["failed"] or plain["oom"]:
        out(f"plain fit without a cap failed: {plain.get('error') or plain.get('stderr_tail')}")
        out("memory proof (TF2): FAILED")
        return
    out(f"plain fit, no cap:         step peak {mib(plain['peak_bytes'])}, "
        f"median step {_ms(plain['step_time_median'])}")
    out(f"cap (half the plain peak): {result['cap_mib']} MiB")
    for label, run in (("plain fit under cap:      ", result["plain_capped"]),
                       ("tfmem.keras under cap:    ", result["tfmem_capped"])):
        if run["failed"]:
            out(f"{label}process failed (exit {run['returncode']}):\n{run['stderr_tail']}")
        elif run["oom"]:
            out(f"{label}{run['error']} (after {len(run['losses'])} steps)")
        else:
            out(f"{label}trained {len(run['losses'])} steps, step peak "
                f"{mib(run['peak_bytes'])}, median step {_ms(run['step_time_median'])}")
    run = result["tfmem_capped"]
    if not run["failed"]:
        if run.get("last_step"):
            out(f"tfmem last step:           {run['last_step']}")
        diff = result["max_rel_diff"]
        out(f"losses match the uncapped plain fit (rtol {RTOL:g}): "
            f"{'yes' if result['losses_match'] else 'no'}"
            + ("" if diff is None else f" (max relative difference {diff:.1e})"))
    out("memory proof (TF2): " + ("PASSED" if result["ok"] else "FAILED"))


def demo_part(out=print):
    """The TF2 part of `tfmem demo --tf2`: run and report the proof; return the exit code."""
    out("")
    out(f"memory proof, TensorFlow 2: Keras MLP {DEFAULTS['layers']}x{DEFAULTS['width']}, batch "
        f"{DEFAULTS['batch']}, {DEFAULTS['steps']} steps; model.fit plain and through "
        "tfmem.keras.partitioned (budget mode under the cap); one fresh process per run")
    result = run_proof(progress=lambda text: out(text))
    report(result, out)
    return 0 if result["ok"] else 1


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m tfmem.cli.proof_tf2",
        description="Fit the TF2 memory-proof model with one system in this process "
                    "(--system), or run the whole three-process proof (no --system).")
    parser.add_argument("--system", choices=SYSTEMS)
    parser.add_argument("--device-memory", type=int, metavar="MiB",
                        help="emulate an accelerator of this many MiB")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    for key in ("steps", "layers", "batch", "width", "prefetch", "seed"):
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=DEFAULTS[key],
                            help=f"(default: {DEFAULTS[key]})")
    parser.add_argument("--partition-size", type=lambda text: text if text == "auto" else int(text),
                        default=DEFAULTS["partition_size"],
                        help="an int, or 'auto': budget mode under the cap (default: auto)")
    parser.add_argument("--swap", choices=("auto", "all", "none"), default=DEFAULTS["swap"])
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    model = dict(steps=args.steps, layers=args.layers, batch=args.batch, width=args.width,
                 seed=args.seed)
    settings = dict(partition_size=args.partition_size, swap=args.swap, prefetch=args.prefetch)
    if args.system is None:
        result = run_proof(**model, **settings,
                           progress=None if args.json else (lambda t: print(t, flush=True)))
        print(json.dumps(result)) if args.json else report(result)
        return 0 if result["ok"] else 1
    if args.device_memory is not None:
        tfmem.emulate_accelerator(args.device_memory)  # before TensorFlow is imported
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    result = train(args.system, **model, **settings)
    print(json.dumps(result) if args.json else result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
