"""`python -m lumen_jax.plan`: see lumen_jax/plan/cli.py."""

import sys

from lumen_jax.plan.cli import main

sys.exit(main())
