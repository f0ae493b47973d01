"""`python -m pyinfer`: the `pyinfer` command."""

import sys

from pyinfer.apps.cli import main

sys.exit(main())
