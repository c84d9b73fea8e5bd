"""The names the kernels dispatch on, with their integer codes, importable without loading Numba (the settings
and the command line need them; `fsd-local --help` must stay fast)."""

MODES = ("fsd", "fsd-paper", "sd", "ar", "draft-only", "typical", "cascade", "relaxed", "fsd-entropy")
FSD, FSD_PAPER, SD, AR, DRAFT_ONLY, TYPICAL, CASCADE, RELAXED, FSD_ENTROPY = range(9)
# the rules that read the target's distribution alone (no divergence): each rescues, after a failed SD test, a
# draft token the target rates highly enough (docs/design.md, "The acceptance rules"); tau is each rule's one knob
TARGET_RULES = ("typical", "cascade", "relaxed")
DIVERGENCE_MODES = ("fsd", "fsd-paper", "fsd-entropy")  # the modes whose output depends on the divergence
TAU_MODES = DIVERGENCE_MODES + TARGET_RULES  # the modes whose output depends on tau
SPECULATIVE_MODES = ("sd",) + TAU_MODES  # a drafter proposes, the target verifies
REJECTED, BY_SD, BY_FUZZY = 0, 1, 2  # why a slot was accepted (the core statistic)

DIVERGENCES = ("js", "kl", "rkl", "tv", "topk-js", "topk-kl", "topk-tv", "paper-js")
JS, KL, RKL, TV, TOPK_JS, TOPK_KL, TOPK_TV, PAPER_JS = range(8)
TOPK_DEFAULT = 50  # k of the topk-* divergences, as in the reference code
# Medusa's typical acceptance: posterior_threshold eps and posterior_alpha a (its defaults)
TYPICAL_EPS_DEFAULT, TYPICAL_ALPHA_DEFAULT = 0.09, 0.3
RELAXED_K_DEFAULT = 10  # top-k window of the relaxed rule (TensorRT-LLM's own default, 1, would be the SD test)

DRAFTERS = ("model", "ngram", "ngram+model")  # who proposes: the draft GGUF, prompt lookup, or lookup first
DRAFT_POLICIES = ("fixed", "adaptive", "auto")  # how many tokens a round drafts (drafting/length.py)

# the state vector of one reply's quality budget (kernels/budget.py; read by stats.py): TAU the threshold the rule
# uses now (TAU0 x G); REFUSED the rescues refused, CAPPED those refused by the hard cap alone; STOP_AT this
# round's draft that ends the reply; CHARGED the sampled rescues charged (LOSS / CHARGED: a typical charge)
BUDGET_STATE = (
    "LOSS",
    "TOKENS",
    "TAU",
    "TAU_SUM",
    "TAU_MIN",
    "TAU_MAX",
    "ROUNDS",
    "REFUSED",
    "G",
    "TAU0",
    "DRAFTED",
    "ACCEPTED",
    "CAPPED",
    "STOP_AT",
    "CHARGED",
)
LOSS, TOKENS, TAU, TAU_SUM, TAU_MIN, TAU_MAX, ROUNDS, REFUSED, G, TAU0, DRAFTED, ACCEPTED, CAPPED, STOP_AT = range(14)
CHARGED = 14
