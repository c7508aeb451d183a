"""The command line wing: ``tfmem <command>`` and what its commands show.

    commands.py     the argument parser: ``tfmem demo | plan | run``
    arguments.py    argument types the commands share
    plan.py         ``tfmem plan``: plan a saved graph without running it
    run.py          ``tfmem run``: the command line of tfmem.autowrap
    run_summary.py  what ``tfmem run`` prints at exit
    demo.py         the side-by-side demo
    proof.py, proof_tf2.py   the memory proofs (``python -m tfmem.cli.proof``)
    models.py       small graph-mode models for tests, benchmarks and experiments
    plot.py, serialize.py    a plan as an image, as JSON
    child_env.py, provenance.py   measuring child processes and where a figure comes from

Called ``cli`` rather than ``tools``: the repository already has a ``tools/``
folder of scripts, and the console script of every existing install points at
``tfmem.cli:main``.  Top of the stack: it may import every other wing.
"""


def main(argv=None):
    """Entry point of the ``tfmem`` console script; returns the exit code.

    Imports the commands on call, so that importing a module of this wing
    (``tfmem.cli.models``) does not import every command.
    """
    from tfmem.cli.commands import main as run_command  # pylint: disable=import-outside-toplevel
    return run_command(argv)
