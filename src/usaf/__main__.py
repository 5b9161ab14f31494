"""`python -m usaf ...`: the CLI, so launchers that take a module (torchrun -m, accelerate launch -m) can start it."""

import sys

from usaf.cli import main

sys.exit(main())
