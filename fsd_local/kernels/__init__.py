"""Everything Numba: the per-round arithmetic on logit rows (divergences, sampling, the acceptance rule).
Importing the package loads no Numba: `names` (the mode and divergence names) is pure Python, and each kernel
module loads Numba when it is imported."""
