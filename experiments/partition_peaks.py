"""Each partition's predicted peak beside its measured one, for an experiment's model.

One process, the BFC allocator far above the step (no cap), tfmem with the
experiment's settings and `measure="every"` (callables: partial runs return no
step statistics); after `--steps` steps (default 3), `memory_report()`'s per-partition
figures of the last step and the allocator's resident bytes.  This is how a
trial that ran out of device memory at a fixed partition size is compared
with what tfmem predicted for it.

    python experiments/partition_peaks.py moe --experts 22 --steps 3
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MIB = 1 << 20
DEFAULT_STEPS = 3  # without --steps (the experiments' trials adapt theirs; this one need not)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("model", choices=("resnet", "moe", "deepspeech"))
    known, rest = parser.parse_known_args(argv)
    import common  # pylint: disable=import-outside-toplevel
    import tfmem  # pylint: disable=import-outside-toplevel
    from tfmem.cli import child_env  # pylint: disable=import-outside-toplevel
    tf, experiment, args, model = common.script_model(known.model, rest,
                                                      child_env.MEASURE_LIMIT_MIB)
    from tfmem.run import accelerator  # pylint: disable=import-outside-toplevel
    sess = tf.compat.v1.Session(graph=model.graph, config=common.session_config(
        tf, "tfmem", args.inter_op_threads, args.intra_op_threads))
    tfs = tfmem.TFMemSession(sess, **common.tfmem_settings(args, measure="every"))
    sess.run(model.init)
    after_init = accelerator.device_memory("CPU:0")["current"]
    for _ in range(args.steps or DEFAULT_STEPS):
        tfs.run([model.train_op, model.loss], feed_dict=model.feed)
    report = tfs.memory_report()
    print(f"{known.model} {experiment.size} {args.size}, partition_size {args.partition_size}: "
          f"{len(report.predicted_partition_peaks)} partitions; last step predicted "
          f"{report.predicted_device_peak / MIB:.2f} MiB, measured {report.device_peak / MIB:.2f} "
          f"MiB; resident after init {after_init / MIB:.2f} MiB, after the steps "
          f"{accelerator.device_memory('CPU:0')['current'] / MIB:.2f} MiB")
    for index, (predicted, measured) in enumerate(zip(report.predicted_partition_peaks,
                                                      report.partition_peaks)):
        print(f"  partition {index:3d}: predicted {predicted / MIB:7.2f}  measured "
              f"{measured / MIB:7.2f}  ({(measured - predicted) / MIB:+.2f}) MiB")
    tfs.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
