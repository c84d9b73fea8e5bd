"""Benchmarks: side-by-side runs of settings (runner), prompt files, the kernel benchmark, plots, the tau search of
`fsd-local calibrate`, the batch costs, the loop's overhead, the server under load, and the comparison with
llama.cpp's own speculative decoding."""
