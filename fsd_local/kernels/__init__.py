"""Everything Numba: the per-round arithmetic on logit rows (divergences, sampling, the acceptance rule).

Importing this package imports nothing heavy: `names` holds the mode and divergence names that settings and
the command line need without loading Numba; the kernel modules load it when they are imported.
"""
