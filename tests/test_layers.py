"""The wings import only from the layers below them (read from the source, nothing runs).

    errors, tf_private   bottom: any module may import them
    plan             pure planning: imports only plan (and the bottom)
    memory           predictions: plan and memory
    run              the runtime: plan, memory and run
    cli              the command line: anything, the public top-level names included

Top-level modules other than errors/tf_private (autowrap, keras, tf2, the
package itself) sit above every wing and may import from any of them.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tfmem"
BOTTOM = {"tfmem.errors", "tfmem.tf_private"}
RANK = {"plan": 1, "memory": 2, "run": 3, "cli": 4}
WING_PACKAGES = {"tfmem"} | {f"tfmem.{wing}" for wing in RANK}


def module_name(path, package=PACKAGE):
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def rank_of(module):
    """A module's layer: 0 bottom, 1-4 a wing, 5 the top level above the wings."""
    if module in BOTTOM:
        return 0
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in RANK:
        return RANK[parts[1]]
    return 5


def imported_modules(source):
    """Every tfmem module a source file imports, with the line of the import."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "tfmem":
            for alias in node.names:
                # `from tfmem.run import accelerator` imports a module of the wing.
                yield (f"{node.module}.{alias.name}" if node.module in WING_PACKAGES
                       else node.module), node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "tfmem":
                    yield alias.name, node.lineno


def layer_slips(package=PACKAGE):
    """['tfmem.memory.x:12 imports tfmem.run.y'] for every import from a higher layer."""
    slips = []
    for path in sorted(package.rglob("*.py")):
        module = module_name(path, package)
        rank = rank_of(module)
        if rank == 5:
            continue
        for imported, line in imported_modules(path.read_text()):
            allowed = rank_of(imported) <= rank or (rank == RANK["cli"])
            if not allowed:
                slips.append(f"{module}:{line} imports {imported}")
    return slips


def test_every_wing_imports_only_from_the_layers_below():
    assert layer_slips() == []


def test_every_module_is_in_a_wing_or_named_at_the_top():
    top = sorted(module_name(p) for p in PACKAGE.glob("*.py"))
    assert top == ["tfmem", "tfmem.__main__", "tfmem.autowrap", "tfmem.errors",
                   "tfmem.keras", "tfmem.tf_private"]


@pytest.mark.parametrize("line, slip", [
    ("from tfmem.run.executing.swap_manager import Schedule", True),
    ("from tfmem.run import accelerator", True),
    ("import tfmem.cli.models", True),
    ("from tfmem import keras", True),
    ("from tfmem.plan.schedule import Schedule", False),
    ("from tfmem.errors import BudgetError", False),
])
def test_the_checker_finds_a_slip_in_the_memory_wing(tmp_path, line, slip):
    (tmp_path / "tfmem" / "memory").mkdir(parents=True)
    (tmp_path / "tfmem" / "memory" / "probe.py").write_text(line + "\n")
    found = layer_slips(tmp_path / "tfmem")
    assert bool(found) == slip, found
