"""Command line interface: ``tfmem <command> [options]``.

Commands:
  demo   train a small MLP through a plain Session and TFMemSession side by
         side and compare losses and step times, optionally under an
         emulated accelerator's memory (``--device-memory MiB``); then run
         the memory proof, plain TensorFlow against tfmem under half the
         plain peak (see :mod:`tfmem.cli.demo` and :mod:`tfmem.cli.proof`).
  plan   plan one request of a saved graph (.meta, .pb, .pbtxt) as
         TFMemSession would, predict its memory per partition without
         running it, and optionally write the plan as JSON, a memory plot and
         a Chrome trace of the planned step (see :mod:`tfmem.cli.plan`).
  run    run an unmodified training script with every Session,
         InteractiveSession and monitored session it creates going through
         tfmem, and print what its steps cost at exit (see :mod:`tfmem.cli.run`).
"""

import argparse

from tfmem.cli import demo, plan as plan_command, run as run_command


def _run_demo(args):
    return demo.run(args)


def _run_plan(args):
    return plan_command.run(args)


def build_parser():
    parser = argparse.ArgumentParser(
        prog="tfmem",
        description="Partitioned execution of TensorFlow graph-mode requests.")
    commands = parser.add_subparsers(dest="command", metavar="<command>")
    demo_parser = commands.add_parser(
        "demo", help="train a small MLP with and without tfmem and compare, then run "
                     "the memory proof",
        description="Train a small MLP through a plain Session and TFMemSession "
                    "side by side and compare losses and step times, then run the "
                    "memory proof: a step plain TensorFlow cannot fit in half its peak "
                    "memory trains under tfmem with the same losses.")
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(func=_run_demo)
    _add_command(commands, "plan", plan_command, _run_plan,
                 "plan a saved graph's request and predict its memory, without running it")
    _add_command(commands, "run", run_command, run_command.run,
                 "run a training script with every session it creates wrapped in tfmem")
    return parser


def _add_command(commands, name, module, func, summary):
    """A subcommand whose module gives its DESCRIPTION, EPILOG and add_arguments."""
    command = commands.add_parser(name, help=summary, description=module.DESCRIPTION,
                                  epilog=module.EPILOG,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(command)
    command.set_defaults(func=func)


def main(argv=None):
    """Entry point of the ``tfmem`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
