"""The offline demo pair (public path kept for apps: `from fsd_local.demo import demo_pair`)."""

from fsd_local.pairs.demo import DEMO_NOTE, PRECISIONS, demo_pair

__all__ = ["DEMO_NOTE", "PRECISIONS", "demo_pair"]
