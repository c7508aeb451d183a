"""The run wing's flat module names still import, as the module in its concern's folder,
with a DeprecationWarning naming the new path."""
import importlib
import os
import warnings

import pytest

import tfmem
from tfmem.run import moved_modules

RUN = os.path.join(os.path.dirname(tfmem.__file__), "run")


@pytest.mark.parametrize("name", sorted(moved_modules.FOLDER_OF))
def test_a_flat_name_imports_the_module_at_its_new_path_with_a_warning(name):
    new = importlib.import_module(f"tfmem.run.{moved_modules.FOLDER_OF[name]}.{name}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = importlib.import_module(f"tfmem.run.{name}")
    assert old is new
    assert any(issubclass(w.category, DeprecationWarning) and new.__name__ in str(w.message)
               for w in caught)


def test_every_run_module_lives_in_a_folder_the_old_names_know():
    flat = {name[:-3] for name in os.listdir(RUN) if name.endswith(".py")}
    assert flat == {"__init__", "moved_modules"}
    in_folders = {name[:-3] for folder in set(moved_modules.FOLDER_OF.values())
                  for name in os.listdir(os.path.join(RUN, folder))
                  if name.endswith(".py") and name != "__init__.py"}
    assert in_folders == set(moved_modules.FOLDER_OF)


def test_a_name_that_never_existed_is_not_found():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("tfmem.run.no_such_module")
