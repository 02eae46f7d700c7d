"""Relative tolerances chosen from the dtype (fixed; never loosened to make a test pass), and a
leaf-wise closeness check of two pytrees."""

import jax
import numpy as np

FP32_RTOL = 1e-5
BF16_RTOL = 1e-2
FP16_RTOL = 1e-2  # float16 has 3 more mantissa bits than bfloat16; the same bound is conservative
RTOL = {"float32": FP32_RTOL, "bfloat16": BF16_RTOL, "float16": FP16_RTOL}  # by compute dtype
# The same math in float32, only the summation order differs (the CPU formulations of the ops against
# the plain ones, tests/ops/test_cpu_formulations.py): tighter than FP32_RTOL on purpose.
SAME_MATH_FP32_RTOL = 1e-6
# After a step an fp8 run depends on roundings: an fp32 difference in the last place can move an
# E4M3/E5M2 value by one of its steps (1/8, 1/4 relative), so fp8 runs after their first step are
# compared at 1e-3 (the gap measured on 3 steps of a pipelined run: 1.1e-4); the first step, from the
# same weights, at FP32_RTOL.
FP8_STEPS_RTOL = 1e-3


def assert_tree_close(actual, expected, rtol: float, what: str = "") -> None:
    """Leaf-wise closeness with atol = rtol * max|expected| of the leaf (fp reduction order differs)."""
    flat_a = jax.tree_util.tree_leaves_with_path(actual)
    flat_e = jax.tree.leaves(expected)
    assert len(flat_a) == len(flat_e)
    for (path, a), e in zip(flat_a, flat_e):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * float(np.abs(e).max() + 1e-30),
                                   err_msg=f"{what}{jax.tree_util.keystr(path)}")
