"""`python -m tools.fuzz`: the fuzzing campaign."""

import sys

from tools.fuzz.campaign import main

sys.exit(main())
