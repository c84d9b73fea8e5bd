"""Everything llama.cpp: the bindings, one loaded model, the vocabulary check, chat templates, GGUF headers, backends
and devices, CPU features, GPU placement and the doctor report. Importing the package loads nothing heavy: `options`
is pure Python, and the other modules load llama-cpp-python when they are imported."""
