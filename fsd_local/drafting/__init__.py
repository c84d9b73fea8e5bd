"""Who drafts and how much: prompt lookup (ngram.py), the draft model and its catch-up (proposer.py), the draft
length (length.py, cost_model.py, verify_cost.py) and the measured costs on disk (calibration.py); docs/design.md,
"Drafting and the draft length"."""
