"""llama.cpp's backend samplers (its backend sampling API): a sampler chain in a model's decode graph, so that where
the model runs on a GPU the token is picked on the device and its logit row need not come to the host.

A model's `BackendSampler` attaches, for one generation at a time, greedy (an argmax) or a temperature then a
seeded draw to its sequence, and reads each output row's token. It is used only where the round reads nothing
else of the row (kernels/accept.py needs the rows for a sampled SD test, a divergence, log-probabilities, the
chain's penalties, bias and grammar): the draft's greedy picks where the rule reads no draft row, the target's
verification of a greedy lossless round (its argmax of every row), and the plain steps of ar and draft-only.
Whether it is on is decided per model by where the model runs (`wanted`): on a GPU by default; on the CPU not
(measured there: +0.7 ms per one-token decode, against a host pick of ~0.05 ms). FSD_LOCAL_BACKEND_SAMPLING=on
or off overrides the choice (tests force it on a CPU build to check it against the host path).
"""

from __future__ import annotations

import os

from fsd_local.llama.bindings import lc

ENV = "FSD_LOCAL_BACKEND_SAMPLING"
LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp's "pick a random seed"


def wanted(gpu_layers: int, rpc: bool, n_layer: int) -> bool:
    """Whether a model loaded with these options samples on its device: FSD_LOCAL_BACKEND_SAMPLING=on/off, else
    where the build offloads every layer and the output (gpu_layers -1, or above the model's n_layer: llama.cpp
    keeps the output matrix on the host otherwise) to a GPU or an RPC server's device."""
    forced = os.environ.get(ENV, "auto").strip().lower()
    if forced in ("on", "1", "true"):
        return True
    if forced in ("off", "0", "false"):
        return False
    if 0 <= gpu_layers <= n_layer or not lc.llama_supports_gpu_offload():
        return False
    from fsd_local.llama.backend import local_offload_devices

    return rpc or bool(local_offload_devices())


class BackendSampler:
    """The sampler chain of one model's sequence: `use` attaches one for a generation (or detaches), `token(i)`
    reads the last decode's i-th output's token. `available`: the context was made for it (its outputs per
    sequence raised to a verify batch's)."""

    def __init__(self, ctx, seq: int, available: bool) -> None:
        self.ctx, self.seq, self.available = ctx, seq, available
        self._chain = None
        self.kind: tuple[float, int] | None = None  # (temperature, seed) attached; None: the host samples

    @property
    def active(self) -> bool:
        return self.kind is not None

    def use(self, temperature: float | None, seed: int | None = None) -> None:
        """For the next generation: greedy (temperature 0), a draw at `temperature` from a stream seeded with
        `seed` (None: a random one), or with None no chain (the host reads the rows). The same chain is reset to
        its seed rather than rebuilt: attaching one rebuilds the decode graph."""
        if temperature is None or not self.available:
            self._set(None, None)
            return
        kind = (float(temperature), LLAMA_DEFAULT_SEED if seed is None else int(seed) & 0xFFFFFFFF)
        if kind == self.kind and self._chain is not None:
            lc.llama_sampler_reset(self._chain)  # the draw's stream starts again from its seed
            return
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        if kind[0] <= 0.0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
        else:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(kind[0]))
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(kind[1]))
        self._set(chain, kind)

    def _set(self, chain, kind) -> None:
        if chain is None and self._chain is None:
            return
        if not lc.llama_set_sampler(self.ctx, self.seq, chain):
            if chain is not None:
                lc.llama_sampler_free(chain)
            raise RuntimeError(
                "llama.cpp refused a backend sampler for this model (set FSD_LOCAL_BACKEND_SAMPLING=off)"
            )
        old, self._chain, self.kind = self._chain, chain, kind
        if old is not None:
            lc.llama_sampler_free(old)

    def token(self, i: int = -1) -> int:
        """The token the chain picked at the last decode's batch position i (negative: from the end)."""
        t = lc.llama_get_sampled_token_ith(self.ctx, i)
        if t < 0:
            raise RuntimeError(f"no backend-sampled token at batch position {i}")
        return t

    def take(self, i: int = -1) -> int:
        """token(i), kept: the draw's stream moves on only when a token is accepted (llama.cpp's rule), so
        every token that stays in the text is passed back."""
        t = self.token(i)
        lc.llama_sampler_accept(self._chain, t)
        return t

    def close(self) -> None:
        """Free the chain (after the context: llama.cpp holds it while attached)."""
        if self._chain is not None:
            lc.llama_sampler_free(self._chain)
        self._chain, self.kind = None, None
