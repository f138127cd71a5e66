"""``python -m jaxckpt.cli``: the same as the ``jaxckpt`` console script (the launcher starts agents this way)."""
import sys

from jaxckpt.cli.main import main

sys.exit(main())
