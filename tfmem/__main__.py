"""``python -m tfmem <command>``: same as the ``tfmem`` console script."""

from tfmem.cli import main

raise SystemExit(main())
