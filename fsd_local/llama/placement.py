"""Which layers of the draft and the target go on the GPU: the draft first, as many of its layers as fit, then as many
target layers as the remaining free memory holds (less a headroom per GPU; RPC servers are a pool only the target
uses), the rest on the CPU; sizes come from the GGUF header, the KV cache and a compute-buffer estimate."""

from __future__ import annotations

from dataclasses import dataclass, replace

from fsd_local.llama.options import KV_TYPES, ModelOptions

MiB = 1 << 20
# per device: what free memory does not show yet (cuBLAS/hipBLAS workspaces, allocator slack)
HEADROOM = 256 * MiB


@dataclass(frozen=True)
class Footprint:
    """Device bytes one model needs, in the units n_gpu_layers moves."""

    layers: tuple[int, ...]  # per repeating layer: weights + its KV cache
    output: int  # output head (+ norm)
    compute: int  # compute buffer, once per model that offloads anything

    @property
    def n_layer(self) -> int:
        return len(self.layers)

    def bytes_for(self, ngl: int) -> int:
        n = self.n_layer if ngl < 0 else min(ngl, self.n_layer)
        head = ngl < 0 or ngl > self.n_layer
        if n == 0 and not head:
            return 0
        return sum(self.layers[self.n_layer - n :]) + (self.output if head else 0) + self.compute

    def most_layers_within(self, budget: int) -> int:
        """-1 when everything fits, else the largest n whose bytes fit (0 = all on the CPU)."""
        if self.bytes_for(-1) <= budget:
            return -1
        return next(n for n in range(self.n_layer, -1, -1) if self.bytes_for(n) <= budget)


def footprint(
    info,
    n_ctx: int,
    cache_type_k: str = "f16",
    cache_type_v: str = "f16",
    n_batch: int = 512,
    flash_attn: bool | None = None,
    state_rows: int = 1,
) -> Footprint:
    """From gguf_info.GGUFInfo. KV for sliding-window layers is counted at full n_ctx (an overestimate); a
    recurrent layer's state `state_rows` times (state_shape.rows: sequences, the spare, snapshots)."""
    kv = info.kv_bytes(n_ctx, KV_TYPES[cache_type_k], KV_TYPES[cache_type_v])
    state = [info.state_bytes * state_rows if r else 0 for r in info.recurrent]
    # logits rows + a few activations per batch row; without flash attention the attention scores too
    compute = n_batch * (info.vocab_size + 8 * info.n_embd) * 4
    if flash_attn is not True:
        compute += n_batch * n_ctx * info.n_head * 4
    layers = tuple(map(sum, zip(info.layer_bytes, kv, state)))
    return Footprint(layers=layers, output=info.output_bytes, compute=compute)


@dataclass
class Placement:
    target_ngl: int
    draft_ngl: int | None
    summary: str  # one line for the user: what was chosen and why


def _describe(ngl: int, fp: Footprint, chosen: bool, where: str = "the GPU") -> str:
    if ngl < 0 or ngl > fp.n_layer:
        return f"all {fp.n_layer} layers on {where} ({fp.bytes_for(ngl) / MiB:,.0f} MiB)"
    if ngl == 0:
        return "on the CPU" + (f" (no room on {where})" if chosen else "")
    return f"{ngl}/{fp.n_layer} layers on {where} ({fp.bytes_for(ngl) / MiB:,.0f} MiB), the rest on the CPU"


def plan(
    target: Footprint,
    draft: Footprint | None,
    free: list[int],
    *,
    target_ngl: int | None = None,
    draft_ngl: int | None = None,
    draft_device: int = 0,
    target_devices: list[int] | None = None,
    rpc_free: int = 0,
    headroom: int = HEADROOM,
    no_gpu: str = "no GPU device",
) -> Placement:
    """Pure arithmetic. free: free bytes per local GPU; None for an ngl means "choose it". The draft sits on
    one device (draft_device); the target spreads over target_devices (default all) plus RPC servers."""
    if not free and not rpc_free:
        t = 0 if target_ngl is None else target_ngl
        d = None if draft is None else (0 if draft_ngl is None else draft_ngl)
        who = "draft and target run" if draft is not None else "the target runs"
        return Placement(t, d, f"{no_gpu}: {who} on the CPU (0 GPU layers)")
    # RPC servers are one more pool that only the target draws from
    usable = [max(0, f - headroom) for f in free] + ([rpc_free] if rpc_free else [])
    target_devices = list(range(len(free))) if target_devices is None else list(target_devices)
    target_devices += [len(free)] if rpc_free else []
    has_draft_device = draft_device < len(free)

    def take(amount: int, device: int | None = None) -> None:
        # draft bytes come off its own device; target bytes off its devices, roomiest first
        if device is not None:
            if device < len(free):
                usable[device] = max(0, usable[device] - amount)
            return
        for i in sorted(target_devices, key=lambda i: -usable[i]):
            used = min(amount, usable[i])
            usable[i] -= used
            amount -= used

    draft_auto, target_auto = draft_ngl is None, target_ngl is None
    if draft is not None and draft_ngl is not None:
        take(draft.bytes_for(draft_ngl), draft_device)
    if target_ngl is not None:
        take(target.bytes_for(target_ngl))
    if draft is not None and draft_ngl is None:
        draft_ngl = draft.most_layers_within(usable[draft_device] if has_draft_device else 0)
        take(draft.bytes_for(draft_ngl), draft_device)
    if target_ngl is None:
        target_ngl = target.most_layers_within(sum(usable[i] for i in target_devices))
    # the draft never goes to RPC servers: without a local GPU it is simply on the CPU
    chosen = []
    if draft is not None:
        assert draft_ngl is not None  # given, or chosen above
        chosen.append(f"draft {_describe(draft_ngl, draft, draft_auto and has_draft_device)}")
    target_where = "the GPU" if not rpc_free else "the GPUs and RPC servers" if free else "the RPC servers"
    chosen.append(f"target {_describe(target_ngl, target, target_auto, target_where)}")
    pools = [f"{f / MiB:,.0f} MiB free on GPU {i}" for i, f in enumerate(free)]
    pools += [f"{rpc_free / MiB:,.0f} MiB on RPC servers"] if rpc_free else []
    free_text = ", ".join(pools)
    return Placement(target_ngl, draft_ngl, f"GPU placement: {'; '.join(chosen)} ({free_text})")


def _no_gpu_reason(info) -> str:
    gpu_backends = [b for b in info.backends if b not in ("CPU", "BLAS", "RPC")]
    if not gpu_backends:
        return "CPU-only build of llama-cpp-python (rebuild with native/build.sh cuda|metal|vulkan)"
    return f"the build has {', '.join(gpu_backends)} but sees no GPU device"


def resolve(
    target: ModelOptions, draft: ModelOptions | None, *, target_auto: bool, draft_auto: bool
) -> tuple[ModelOptions, ModelOptions | None, str]:
    """Fill in the automatic GPU-layer counts; returns the options to load and a line saying what was chosen."""
    if not target_auto and not (draft is not None and draft_auto):
        return target, draft, ""
    from fsd_local.llama import backend, gguf_info, state_shape

    if target.rpc_servers:  # their devices count for the target only
        backend.add_rpc_servers(target.rpc_servers)
    info = backend.detect()
    gpus = info.gpus
    rpc_free = sum(d.free for d in info.devices if d.is_rpc) if target.rpc_servers else 0

    def fp(o: ModelOptions, role: str) -> Footprint:
        i = gguf_info.read(o.path, role)
        rows = state_shape.rows(i.architecture, o.n_seq, o.n_rs_seq, o.checkpoint)
        return footprint(i, o.n_ctx, o.cache_type_k, o.cache_type_v, o.n_batch, o.flash_attn, rows)

    draft_device = draft.main_gpu if draft is not None and draft.main_gpu < len(gpus) else 0
    target_devices = [target.main_gpu] if target.split_mode == "none" and target.main_gpu < len(gpus) else None
    p = plan(
        fp(target, "target"),
        fp(draft, "draft") if draft is not None else None,
        [d.free for d in gpus],
        target_ngl=None if target_auto else target.n_gpu_layers,
        draft_ngl=None if draft is None or draft_auto else draft.n_gpu_layers,
        draft_device=draft_device,
        target_devices=target_devices,
        rpc_free=rpc_free,
        no_gpu=_no_gpu_reason(info),
    )
    target = replace(target, n_gpu_layers=p.target_ngl)
    if draft is not None:
        assert p.draft_ngl is not None  # plan() places a draft whenever it is given one
        draft = replace(draft, n_gpu_layers=p.draft_ngl)
    return target, draft, p.summary
