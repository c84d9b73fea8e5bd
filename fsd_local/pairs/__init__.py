"""Draft/target pairs: the curated registry (models.toml, pull from the hub) and the offline demo pair."""
