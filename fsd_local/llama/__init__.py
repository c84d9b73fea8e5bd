"""Everything llama.cpp: the bindings, one loaded model, the vocabulary check, chat templates, GGUF headers,
backends and devices, CPU features, GPU placement and the doctor report.

Importing this package imports nothing heavy: `options` (ModelOptions and the option names) is pure Python;
the other modules load llama-cpp-python when they are imported.
"""
