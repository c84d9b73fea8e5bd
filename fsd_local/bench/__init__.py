"""Benchmarks: side-by-side runs of settings (runner), prompt files, the kernel benchmark, plots, tau
calibration and the comparison with llama.cpp's own speculative decoding."""
