"""`python -m lumen_jax.train --config FILE [section.key=value ...]` (lumen_jax/train/cli.py)."""

import sys

from lumen_jax.train.cli import main

sys.exit(main())
