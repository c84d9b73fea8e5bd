"""The names the kernels dispatch on, with their integer codes, importable without loading Numba (the settings
and the command line need them; `fsd-local --help` must stay fast)."""

MODES = ("fsd", "fsd-paper", "sd", "ar", "draft-only")
FSD, FSD_PAPER, SD, AR, DRAFT_ONLY = range(5)
SPECULATIVE_MODES = ("fsd", "fsd-paper", "sd")  # a draft proposes, the target verifies
TAU_MODES = ("fsd", "fsd-paper")  # the modes whose output depends on tau and the divergence

DIVERGENCES = ("js", "kl", "rkl", "tv", "topk-js", "topk-kl", "topk-tv", "paper-js")
JS, KL, RKL, TV, TOPK_JS, TOPK_KL, TOPK_TV, PAPER_JS = range(8)
TOPK_DEFAULT = 50  # k of the topk-* divergences, as in the reference code

DRAFTERS = ("model", "ngram", "ngram+model")  # who proposes: the draft GGUF, prompt lookup, or lookup first
DRAFT_POLICIES = ("fixed", "adaptive", "auto")  # how many tokens a round drafts (drafting/length.py)
