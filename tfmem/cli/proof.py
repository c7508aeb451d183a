"""Memory proof: tfmem trains a step that plain TensorFlow cannot fit.

Four runs of one activation-heavy MLP, each in a fresh process (the
allocator and its cap are read when TensorFlow starts, see
:mod:`tfmem.cli.child_env`), all under TensorFlow's BFC allocator so that every
run reports figures on every machine:

    (a) plain Session, no cap          -> peak P, reference losses
    (b) plain Session, cap = P/2 MiB   -> must raise ResourceExhaustedError
    (c) TFMemSession,  cap = P/2 MiB   -> must train, losses equal to (a)
    (d) TFMemSession,  no cap          -> its peak must be below P/2, losses equal to (a)

"No cap" is the same BFC allocator with a limit far above the step.  The
kernel path (oneDNN on or off) is set explicitly in every child: (a), (c)
and (d) run the path asked for; (b) always runs without oneDNN, whose
kernels have crashed (SIGSEGV) at a full capped allocator instead of raising
ResourceExhaustedError.  A child that crashes is reported as a crash, never
as running out of memory.  (d) checks a figure that could be wrong: (c)'s
peak is under the cap by construction, (d)'s is not.

The model keeps many activations alive for its backward pass
(``h = relu(h @ w); h = sin(h) * 0.5 + h`` per layer, squared-mean loss,
plain SGD), so its peak is mostly activations, which tfmem swaps to host
memory between partitions.  Weights come from seeded random initialisers,
not numpy constants: a constant initialiser keeps its value in the graph and
that copy would count as device memory in every run.  Sessions use one
intra-op thread and two inter-op threads, so peaks do not depend on the
machine's core count.

``train`` runs one system in the current process and returns a small dict;
``python -m tfmem.cli.proof --system tf|tfmem [--device-memory MiB] --json``
prints that dict as one JSON line; ``run_proof`` starts the four processes
and checks the result.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import tfmem
from tfmem.run.placement import accelerator
from tfmem.cli import child_env
from tfmem.cli.arguments import positive_int
from tfmem.memory.sizes import MIB, mib

RTOL = 1e-4
ATOL = 1e-6

# A proof model that runs in a few seconds per process on 2 CPU cores, with a
# plain peak more than twice tfmem's (docs/results.md, Memory proof, has the numbers).
DEFAULTS = dict(layers=24, batch=1024, width=256, seed=0, steps=5,
                partition_size=20, swap="auto", prefetch=1)

SYSTEMS = ("tf", "tfmem")


def build_model(tf, layers, batch, width, seed, device=None):
    """The proof MLP in a new graph, its ops on `device` if given (tools/gpu_check.py
    pins it to the GPU); returns (graph, x, loss, train_op, init)."""
    from tfmem.cli.models import mlp_layers  # pylint: disable=import-outside-toplevel
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default(), tf.device(device):
        x = tf1.placeholder(tf.float32, [batch, width], name="x")
        h = mlp_layers(x, layers, width, seed)
        loss = tf.reduce_mean(tf.square(h), name="loss")
        train_op = tf1.train.GradientDescentOptimizer(0.01).minimize(loss)
        init = tf1.global_variables_initializer()
    return graph, x, loss, train_op, init


def _batches(np, steps, batch, width, seed):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        yield rng.standard_normal((batch, width)).astype(np.float32)


def _oom_line(message):
    """The informative line of a ResourceExhaustedError message."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    for line in lines:
        if line.startswith("OOM when allocating"):
            return f"ResourceExhaustedError: {line}"
    return f"ResourceExhaustedError: {lines[0] if lines else ''}"


def train(system, steps=DEFAULTS["steps"], layers=DEFAULTS["layers"], batch=DEFAULTS["batch"],
          width=DEFAULTS["width"], seed=DEFAULTS["seed"], partition_size=DEFAULTS["partition_size"],
          swap=DEFAULTS["swap"], prefetch=DEFAULTS["prefetch"]):
    """Train the proof model for `steps` steps in this process with `system`.

    system: "tf" (a plain Session) or "tfmem" (a TFMemSession with the given
    partition_size, swap and prefetch).  Returns a dict: losses (floats, the
    steps that ran), peak_bytes (TensorFlow's CPU allocator peak over the
    steps, measured from after initialisation), oom (a step raised
    ResourceExhaustedError; training stops there), error (its OOM line),
    step_time_median (s), step_times, last_step (the StepStats summary of
    tfmem's last step, else None) and the run's settings.
    """
    if system not in SYSTEMS:
        raise ValueError(f"system must be one of {SYSTEMS}, got {system!r}")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from tfmem.run.placement import accelerator  # pylint: disable=import-outside-toplevel

    graph, x, loss, train_op, init = build_model(tf, layers, batch, width, seed)
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                      inter_op_parallelism_threads=2)
    sess = tf.compat.v1.Session(graph=graph, config=config)
    # measure="every": the proof is about memory, so its last step shows its peak
    runner = sess if system == "tf" else tfmem.TFMemSession(sess, partition_size=partition_size,
                                                            swap=swap, prefetch=prefetch,
                                                            options=tfmem.Options(measure="every"))
    limit = accelerator.emulated_memory_mib()
    result = dict(system=system,
                  device_memory_mib=None if limit == child_env.MEASURE_LIMIT_MIB else limit,
                  allocator_limit_mib=limit, onednn=os.environ.get(child_env.ONEDNN),
                  steps=steps, layers=layers, batch=batch, width=width, seed=seed,
                  partition_size=partition_size if system == "tfmem" else None,
                  swap=swap if system == "tfmem" else None,
                  prefetch=prefetch if system == "tfmem" else None,
                  losses=[], peak_bytes=None, oom=False, error=None,
                  step_times=[], step_time_median=None, last_step=None)
    with sess:
        runner.run(init)
        # The proof's own child process: it resets TensorFlow's peak once after
        # initialisation and keeps the largest peak read after each step.
        accelerator.reset_peak("CPU:0")
        peak = 0
        for value in _batches(np, steps, batch, width, seed):
            started = time.perf_counter()
            try:
                _, loss_value = runner.run([train_op, loss], feed_dict={x: value})
                elapsed = time.perf_counter() - started
            except tf.errors.ResourceExhaustedError as err:
                result["oom"] = True
                result["error"] = _oom_line(err.message)
                break
            finally:
                memory = accelerator.device_memory("CPU:0")
                if memory is not None:
                    peak = max(peak, memory["peak"])
            result["step_times"].append(elapsed)
            result["losses"].append(float(loss_value))
        result["peak_bytes"] = peak
        if result["step_times"]:
            result["step_time_median"] = statistics.median(result["step_times"])
        if system == "tfmem" and runner.last_step is not None:
            result["last_step"] = str(runner.last_step)
            result["partitions"] = runner.last_step.partitions
            result["swapped_out_bytes"] = runner.last_step.swapped_out_bytes
        if system == "tfmem":
            runner.close()
    return result


def _run_subprocess(system, device_memory=None, onednn=False, timeout=600, **settings):
    """`train` in a fresh `python -m tfmem.cli.proof` process; its dict, or one with `failed`.

    device_memory: the cap in MiB, or None for the same BFC allocator without a
    cap.  onednn: the child's kernel path (TF_ENABLE_ONEDNN_OPTS, always set).
    A child that ends without a result is `failed`; one a signal ended is
    also `crashed` (TensorFlow crashed: not an out-of-memory error).
    """
    cmd = [sys.executable, "-m", "tfmem.cli.proof", "--system", system, "--json"]
    if device_memory is not None:
        cmd += ["--device-memory", str(device_memory)]
    for key, value in settings.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    env = child_env.child_env(cap_mib=device_memory, onednn=onednn)
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              check=False)
    except subprocess.TimeoutExpired:
        return dict(system=system, device_memory_mib=device_memory, onednn=env[child_env.ONEDNN],
                    failed=True, crashed=False, returncode=None, command=cmd,
                    how=f"no result within {timeout} s", stderr_tail="")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        return dict(system=system, device_memory_mib=device_memory, onednn=env[child_env.ONEDNN],
                    failed=True, crashed=proc.returncode < 0, returncode=proc.returncode,
                    how=child_env.describe_exit(proc.returncode), stderr_tail=tail, command=cmd)
    result = json.loads(lines[-1])
    result["failed"] = result["crashed"] = False
    result["process_seconds"] = time.perf_counter() - started
    return result


def losses_match(expected, got, rtol=RTOL, atol=ATOL):
    """True when `got` has as many losses as `expected` and each agrees within rtol/atol."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    return (len(expected) > 0 and len(got) == len(expected)
            and bool(np.allclose(got, expected, rtol=rtol, atol=atol)))


def _max_rel_diff(expected, got):
    if len(got) != len(expected) or not expected:
        return None
    return max(abs(g - e) / max(abs(e), 1e-30) for e, g in zip(expected, got))


def _trained(run, steps):
    return run is not None and not run["failed"] and not run["oom"] and len(run["losses"]) == steps


def run_proof(steps=DEFAULTS["steps"], layers=DEFAULTS["layers"], batch=DEFAULTS["batch"],
              width=DEFAULTS["width"], seed=DEFAULTS["seed"],
              partition_size=DEFAULTS["partition_size"], swap=DEFAULTS["swap"],
              prefetch=DEFAULTS["prefetch"], onednn=None, timeout=600, progress=None):
    """Run the four-process memory proof; return a dict of the runs and the verdict.

    onednn: the kernel path of runs (a), (c) and (d); None reads
    TF_ENABLE_ONEDNN_OPTS (unset: off).  Keys: onednn, plain (a), cap_mib (half
    its peak, MiB, rounded down), plain_capped (b), tfmem_capped (c),
    tfmem_uncapped (d) (see `train`); plain_oom ((b) raised
    ResourceExhaustedError), plain_crashed ((b) crashed instead), tfmem_fits ((c)
    trained every step), losses_match and max_rel_diff ((c) against (a)),
    tfmem_peak_ratio ((d)'s peak / (a)'s), tfmem_peak_below_half ((d)'s peak
    under half of (a)'s, its losses equal to (a)'s), reasons (why not ok) and ok.
    progress: optional callable given a line of text before each run.
    """
    if onednn is None:
        onednn = child_env.onednn_from_env()
    model = dict(steps=steps, layers=layers, batch=batch, width=width, seed=seed)
    tfmem_settings = dict(partition_size=partition_size, swap=swap, prefetch=prefetch)
    say = progress or (lambda text: None)
    path = child_env.kernel_path(onednn)

    say(f"plain Session, no cap ({path}) ...")
    plain = _run_subprocess("tf", onednn=onednn, timeout=timeout, **model)
    result = dict(onednn=bool(onednn), plain=plain, cap_mib=None, plain_capped=None,
                  tfmem_capped=None, tfmem_uncapped=None, plain_oom=False, plain_crashed=False,
                  tfmem_fits=False, losses_match=False, max_rel_diff=None,
                  tfmem_peak_ratio=None, tfmem_peak_below_half=False, reasons=[], ok=False)
    if plain["failed"] or plain["oom"] or not plain["peak_bytes"]:
        result["reasons"].append("the uncapped plain run did not train or measured no peak")
        return result
    cap = plain["peak_bytes"] // 2 // MIB
    result["cap_mib"] = cap
    if cap < 1:
        result["reasons"].append("the plain peak is under 2 MiB: no cap to test")
        return result

    say(f"plain Session, cap {cap} MiB (oneDNN off) ...")
    plain_capped = _run_subprocess("tf", device_memory=cap, onednn=False, timeout=timeout, **model)
    say(f"TFMemSession, cap {cap} MiB ({path}) ...")
    tfmem_capped = _run_subprocess("tfmem", device_memory=cap, onednn=onednn, timeout=timeout,
                                   **model, **tfmem_settings)
    say(f"TFMemSession, no cap ({path}) ...")
    tfmem_uncapped = _run_subprocess("tfmem", onednn=onednn, timeout=timeout,
                                     **model, **tfmem_settings)
    result.update(plain_capped=plain_capped, tfmem_capped=tfmem_capped,
                  tfmem_uncapped=tfmem_uncapped)
    result["plain_oom"] = not plain_capped["failed"] and plain_capped["oom"]
    result["plain_crashed"] = plain_capped["crashed"]
    result["tfmem_fits"] = _trained(tfmem_capped, steps)
    expected = plain["losses"]
    if not tfmem_capped["failed"]:
        result["losses_match"] = losses_match(expected, tfmem_capped["losses"])
        result["max_rel_diff"] = _max_rel_diff(expected, tfmem_capped["losses"])
    if _trained(tfmem_uncapped, steps) and tfmem_uncapped["peak_bytes"]:
        result["tfmem_peak_ratio"] = tfmem_uncapped["peak_bytes"] / plain["peak_bytes"]
        result["tfmem_peak_below_half"] = (
            2 * tfmem_uncapped["peak_bytes"] < plain["peak_bytes"]
            and losses_match(expected, tfmem_uncapped["losses"]))
    reasons = result["reasons"]
    if result["plain_crashed"]:
        reasons.append(f"the capped plain run crashed ({plain_capped['how']}) instead of "
                       "raising ResourceExhaustedError")
    elif not result["plain_oom"]:
        reasons.append("the capped plain run did not raise ResourceExhaustedError")
    if not result["tfmem_fits"]:
        reasons.append("TFMemSession did not train every step under the cap")
    elif not result["losses_match"]:
        reasons.append("TFMemSession's losses under the cap differ from the plain run's")
    if not result["tfmem_peak_below_half"]:
        reasons.append("TFMemSession without a cap did not stay under half the plain peak "
                       "with the plain losses")
    result["ok"] = not reasons
    return result


def _ms(seconds):
    return "n/a" if seconds is None else f"{seconds * 1e3:.0f} ms"


def _describe_run(run):
    """What one run did, in a few words."""
    if run["failed"]:
        what = "CRASHED" if run["crashed"] else "process failed"
        return f"{what} ({run['how']}):\n{run['stderr_tail']}"
    if run["oom"]:
        what = (run["error"] or "").split(": ", 1)[-1].split(" on /job")[0]
        return (f"ResourceExhaustedError at step {len(run['losses'])}"
                + (f" ({what})" if what else ""))
    return (f"trained {len(run['losses'])} steps, peak {mib(run['peak_bytes'])}, "
            f"median step {_ms(run['step_time_median'])}")


def report(result, out=print):
    """Print a `run_proof` result, one fact per line."""
    plain, cap = result["plain"], result["cap_mib"]
    path = child_env.kernel_path(result["onednn"])
    if plain["failed"] or plain["oom"]:
        out(f"plain Session without a cap failed: {_describe_run(plain)}")
        out("memory proof: FAILED (" + "; ".join(result["reasons"]) + ")")
        return
    out(f"kernel path: {path} (the capped plain run: oneDNN off); every run under "
        f"TensorFlow's BFC allocator")
    out(f"plain Session, no cap:     peak {mib(plain['peak_bytes'])}, "
        f"median step {_ms(plain['step_time_median'])}")
    out(f"cap (half the plain peak): {cap} MiB")
    for label, key in (("plain Session under cap: ", "plain_capped"),
                       ("TFMemSession under cap:  ", "tfmem_capped"),
                       ("TFMemSession, no cap:    ", "tfmem_uncapped")):
        if result[key] is not None:
            out(f"{label} {_describe_run(result[key])}")
    tfmem_run = result["tfmem_capped"]
    if tfmem_run is not None and not tfmem_run["failed"] and tfmem_run.get("last_step"):
        out(f"TFMemSession last step:    {tfmem_run['last_step']}")
    if tfmem_run is not None and not tfmem_run["failed"]:
        diff = result["max_rel_diff"]
        diff_text = "" if diff is None else f" (max relative difference {diff:.1e})"
        out(f"losses match the uncapped plain run (rtol {RTOL:g}): "
            f"{'yes' if result['losses_match'] else 'no'}{diff_text}")
    if result["tfmem_peak_ratio"] is not None:
        out(f"TFMemSession's peak without a cap: {result['tfmem_peak_ratio']:.2f}x the plain "
            f"peak (must be under 0.5x)")
    if plain["step_time_median"] and tfmem_run and tfmem_run.get("step_time_median"):
        out(f"median time per step: plain (no cap) {_ms(plain['step_time_median'])}, "
            f"tfmem (cap) {_ms(tfmem_run['step_time_median'])} "
            f"({tfmem_run['step_time_median'] / plain['step_time_median']:.2f}x)")
    out("memory proof: " + ("PASSED" if result["ok"]
                            else "FAILED (" + "; ".join(result["reasons"]) + ")"))


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m tfmem.cli.proof",
        description="Train the memory-proof MLP with one system in this process "
                    "(--system), or run the whole four-process proof (no --system).")
    parser.add_argument("--system", choices=SYSTEMS,
                        help="train with a plain Session (tf) or a TFMemSession (tfmem) "
                             "in this process; without it, run the whole proof")
    parser.add_argument("--device-memory", type=positive_int, metavar="MiB",
                        help="emulate an accelerator of this many MiB (TensorFlow's CPU "
                             "allocator capped, see tfmem.emulate_accelerator)")
    parser.add_argument("--onednn", choices=("0", "1"),
                        help="kernel path: sets TF_ENABLE_ONEDNN_OPTS (default: its value in "
                             "the environment; the whole proof treats unset as 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    for key in ("steps", "layers", "batch", "width", "partition_size", "prefetch"):
        kind = int if key == "prefetch" else positive_int
        parser.add_argument(f"--{key.replace('_', '-')}", type=kind, default=DEFAULTS[key],
                            help=f"(default: {DEFAULTS[key]})")
    parser.add_argument("--seed", type=int, default=DEFAULTS["seed"],
                        help=f"(default: {DEFAULTS['seed']})")
    parser.add_argument("--swap", choices=("auto", "all", "none"), default=DEFAULTS["swap"],
                        help=f"(default: {DEFAULTS['swap']})")
    return parser


def main(argv=None):
    """`python -m tfmem.cli.proof`; returns the exit code."""
    args = build_parser().parse_args(argv)
    model = dict(steps=args.steps, layers=args.layers, batch=args.batch,
                 width=args.width, seed=args.seed)
    tfmem_settings = dict(partition_size=args.partition_size, swap=args.swap,
                          prefetch=args.prefetch)
    if args.system is None:
        if args.device_memory is not None:
            build_parser().error("--device-memory needs --system (the proof picks its own cap)")
        onednn = None if args.onednn is None else args.onednn == "1"
        result = run_proof(**model, **tfmem_settings, onednn=onednn,
                           progress=None if args.json else (lambda text: print(text, flush=True)))
        if args.json:
            print(json.dumps(result))
        else:
            report(result)
        return 0 if result["ok"] else 1
    # Before TensorFlow is imported: it reads both when it starts.
    if args.onednn is not None:
        os.environ[child_env.ONEDNN] = args.onednn
    if args.device_memory is not None:
        tfmem.emulate_accelerator(args.device_memory)
    elif accelerator.emulated_memory_mib() is None:
        # No cap: the same BFC allocator with a limit far above the step, so
        # that TensorFlow keeps figures whatever the kernel path.
        tfmem.emulate_accelerator(child_env.MEASURE_LIMIT_MIB)
    result = train(args.system, **model, **tfmem_settings)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.system}: losses {', '.join(f'{v:.6f}' for v in result['losses'])}")
        print(f"peak {mib(result['peak_bytes'])}, median step {_ms(result['step_time_median'])}"
              + (f", {result['error']}" if result["oom"] else ""))
        if result["last_step"]:
            print(f"last step: {result['last_step']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
