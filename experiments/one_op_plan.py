"""Train an experiment's model with one op per partition, whatever budget mode would say.

Budget mode refuses a plan whose predicted peak, in the allocator's chunks,
passes 90 % of the budget.  This runs the plan it would have refused (one op
per partition, every tensor swapped, partial runs, nothing measured by tfmem)
for a few steps under the emulated cap, and prints TensorFlow's own allocator
peak of each step beside both predictions: whether the device can hold the
step, not whether budget mode would plan it.

    python experiments/one_op_plan.py resnet --layers 160 --device-memory 96 --allocator one-region

The variables are initialised through a budget-mode wrapper (one partition),
as the experiments' trials do, so the initializer's constants do not stay
resident; the steps then run through a `TFMemSession(partition_size=1,
swap_distance=0)` over the same session.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MIB = 1 << 20


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("model", choices=("resnet", "moe", "deepspeech"))
    parser.add_argument("--device-memory", type=int, required=True, metavar="MiB")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--allocator", choices=("grown", "one-region"), default="grown",
                        help="as the experiments' --allocator")
    known, rest = parser.parse_known_args(argv)
    import common  # pylint: disable=import-outside-toplevel
    import tfmem  # pylint: disable=import-outside-toplevel
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    tfmem.emulate_accelerator(known.device_memory)
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tfmem.run import accelerator  # pylint: disable=import-outside-toplevel
    if known.allocator == "one-region":
        tfmem.reserve_emulated_memory()
    _, experiment, args, model = common.script_model(known.model, rest, known.device_memory)
    config = common.session_config(tf, "tfmem", args.inter_op_threads, args.intra_op_threads,
                                   args.session_config)
    sess = tf.compat.v1.Session(graph=model.graph, config=config)
    tfmem.TFMemSession(sess, partition_size="auto").run(model.init)
    tfs = tfmem.TFMemSession(sess, partition_size=1, swap_distance=0, partial_runs=True,
                             measure="off")
    print(f"{known.model} {experiment.size} {args.size}, cap {known.device_memory} MiB, "
          f"allocator {known.allocator}: {common.provenance_note(common.provenance(args))}")
    accelerator.reset_peak("CPU:0")
    for step in range(known.steps):
        started = time.perf_counter()
        try:
            _, loss = tfs.run([model.train_op, model.loss], feed_dict=model.feed)
        except tf.errors.ResourceExhaustedError as err:
            print(f"step {step}: out of device memory: {err.message.splitlines()[0]}")
            return 1
        report, memory = tfs.memory_report(), accelerator.device_memory("CPU:0")
        accelerator.reset_peak("CPU:0")
        print(f"step {step}: {time.perf_counter() - started:.1f} s, loss {loss:.4f}, "
              f"{tfs.last_step.partitions} partitions; predicted "
              f"{report.predicted_device_peak / MIB:.1f} MiB requested, "
              f"{report.predicted_device_peak_chunks / MIB:.1f} in chunks; TensorFlow's "
              f"peak {memory['peak'] / MIB:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
