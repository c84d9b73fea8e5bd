"""`python -m fsd_local.compare_llamacpp`: kept at this path; the code lives in fsd_local.bench.compare_llamacpp."""

from fsd_local.bench.compare_llamacpp import main

if __name__ == "__main__":
    main()
