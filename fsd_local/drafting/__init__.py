"""Drafting without (or besides) a draft model, and choosing how much to draft (docs/design.md,
"Drafting and the draft length").

- `ngram.NgramDrafter`: prompt lookup. The longest recent n-gram at the end of the text that occurred earlier
  proposes the tokens that followed it. Free (microseconds a round) and strong where the output repeats the
  input: code edits, extraction, rewriting, quoting. Its q is one-hot on each proposed token; the divergences of
  a target row against a one-hot are in `fsd_local.kernels.onehot`.
- `length.DraftLength`: how many tokens a round drafts, under the settings' `draft_policy`. For `auto` it keeps
  a `cost_model.CostModel` per source of drafts, which measures draft and verification costs and the acceptance
  per draft position online and picks the k in [0, k_max] with the highest expected tokens per second,
  re-probing so that a policy that settled on k = 0 (plain target steps) can come back.
- `proposer.Proposer`: who drafts this round (the draft model, prompt lookup, or lookup first) into the round
  buffers, and the draft model's catch-up after plain steps.

The package sits above kernels/ and llama/ and below the engine (the layers of tests/test_architecture.py).
ngram.py, cost_model.py, verify_cost.py and length.py work on plain numbers and token lists; proposer.py drafts
with the draft model (llama/model.py) and calibration.py times both models (`measure_costs`) and keeps their costs
on disk.
"""
