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


def test_every_old_name_names_a_module_in_its_folder():
    # A module that never had a flat name needs none.
    flat = {name[:-3] for name in os.listdir(RUN) if name.endswith(".py")}
    assert flat == {"__init__", "moved_modules"}
    missing = [name for name, folder in moved_modules.FOLDER_OF.items()
               if not os.path.exists(os.path.join(RUN, folder, name + ".py"))]
    assert not missing


def test_a_name_that_never_existed_is_not_found():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("tfmem.run.no_such_module")
