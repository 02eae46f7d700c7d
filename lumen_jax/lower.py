"""`python -m lumen_jax.lower --config FILE --platform cuda [...]`: the command; the code is lumen_jax/plan/lower.py."""

import sys

from lumen_jax.plan.lower import main

if __name__ == "__main__":
    sys.exit(main())
