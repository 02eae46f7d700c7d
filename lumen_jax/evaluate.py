"""`python -m lumen_jax.evaluate --run-dir DIR [...]`: the command; the code is lumen_jax/train/evaluate.py."""

import sys

from lumen_jax.train.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
