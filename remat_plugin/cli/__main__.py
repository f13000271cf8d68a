"""``python -m remat_plugin.cli``: the ``remat`` command."""
import sys

from remat_plugin.cli.main import main

sys.exit(main())
