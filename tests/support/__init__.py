"""What the tests share that is not a test: tiny GGUF models written on the fly (tinymodels), a loopback model hub
(loopback_hub), local model stores laid out from tiny models (localstores), `fsd-local serve` as a process
(serving), the command line in this process (clirun), chat templates with tools (tool_templates), the `auto`
policy replayed on traces (autosim), random rounds for the acceptance kernel (rounds), and the float64 NumPy
references the kernels are checked against (reference, reference_onehot, reference_rules).

Reached as `support.*`: pyproject.toml's `[tool.pytest.ini_options] pythonpath` puts tests/ on the path.
"""
