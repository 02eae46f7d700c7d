"""`python -m lumen_jax.lower --config FILE [--platform cuda | --against-xla] [...]`: the command; the code is
lumen_jax/compiler/lower.py."""

import sys

from lumen_jax.compiler.lower import main

if __name__ == "__main__":
    sys.exit(main())
