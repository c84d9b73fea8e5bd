"""Draft/target pairs: the curated registry (models.toml, pull from the hub), the offline demo pairs (demo.py, and
wide.py's cost-realistic target), the GGUF files other apps keep on this disk (stores.py, local.py,
header_index.py) and the names the command line takes for them (names.py)."""
