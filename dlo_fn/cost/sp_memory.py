"""Activation and communication bytes per rank of one block under Ulysses SP, as functions of tokens, sp and sizes.

Notation: ``L`` tokens of one sequence, ``S`` sp ranks, ``l = ceil(L / S)`` tokens per rank, ``B`` sequences
per pass (CFG branches), ``D`` hidden width, ``M`` MLP width, ``e`` weight itemsize (2 for bf16), ``f = 4``
(the fp32 residual stream, norms and rotary), ``u = B l D`` elements. The reference block
(:mod:`dlo_fn.models.dit`, inference, no autograd) holds, at each phase, these device tensors (bytes)::

    phase                   activations                                               communication
    qk norm + rotary        x f u, h f u, qkv 3e u, q e u, k.float f u, rms(k) f u     -
    attention (S = 1)       x, h, qkv, q, k (e u each), out e u                        -
    tokens -> heads (S>1)   x, h, qkv, q, k, stack(q,k,v) 3e u, heads copy 3e u        send 3e u, recv 3e u
    heads -> tokens (S>1)   x, h, heads 3e u, out e u, [padded e u], tokens e u        [send e u], recv e u
    cross-attn q norm       x, h, modulated f u, q e u, q.float f u, rms(q) f u        -
    MLP                     x, h, modulated f u, fc1 e B l M, gelu e B l M             -

``h`` (the first modulated input) stays alive for the whole block (a Python local of ``DiTBlock.forward``), and
the embedding's output ``x0`` (``f u``) for the whole pass (``EmbedState.x``, held by ``VideoDiT.forward``).
Bracketed terms exist only when a copy is made: the padded attention output when ``S l > L``; a separate send
buffer for heads -> tokens only when ``B > 1`` (at ``B = 1`` the permute is already contiguous, so the padded
output itself is sent). The attention output needs no flattening copy: SDPA returns it token-major. Checked on
CPU with the profiler's allocation events (the live bytes at each all-to-all call match these terms) and on one
H200 (``bench sp-hbm --explain-peak``: the allocations alive at the measured peak are exactly the tokens ->
heads terms, within 0.1%; ``figures/data/sp_hbm_nvidia-h200_explain.json``).
The peak is the largest phase; with ``S > 1`` it is the tokens -> heads all-to-all: ``(3f + 9e) u`` of
activations (``x0`` included) plus ``6e u`` of send and receive buffers, ``46 B l D`` bytes at bf16 (vs the MLP's
``(4f + 4e M / D) u ~ 32.5 u`` for Nano). Every term scales with ``l``: SP divides them by ``S``. Two small
terms ride along in every phase: the rotary tables ``f L d_h`` (this rank's rows of cos and sin are views of
the whole tables, which therefore stay alive) and the inputs (the full latents ``f B L P`` on every sp rank, the
text states ``f B T_t D_t``).

A model, not a measurement: which kernels copy is a property of torch's implementation; the measured per-rank
peak on one H200 is set beside it in notebook 08.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BlockDims", "Phase", "SPActivations", "sp_activations"]

FP32_BYTES = 4


@dataclass(frozen=True, slots=True)
class BlockDims:
    """The widths the activation model needs (a DiT config has every field: :meth:`from_config`)."""

    hidden_dim: int
    mlp_dim: int
    num_heads: int
    patch_dim: int = 0
    text_len: int = 0
    text_dim: int = 0
    weight_itemsize: int = 2

    def __post_init__(self) -> None:
        for name in ("hidden_dim", "mlp_dim", "num_heads", "weight_itemsize"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"BlockDims.{name} must be a positive int, got {value!r}")
        if self.hidden_dim % self.num_heads:
            raise ValueError(f"hidden_dim {self.hidden_dim} is not a multiple of num_heads {self.num_heads}")

    @classmethod
    def from_config(cls, config, weight_itemsize: int = 2) -> "BlockDims":
        """From any object with a DiT config's fields (``dlo_fn.models.DiTConfig``)."""
        return cls(
            config.hidden_dim,
            config.mlp_dim,
            config.num_heads,
            config.patch_dim,
            config.text_len,
            config.text_dim,
            weight_itemsize,
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_dim // self.num_heads


@dataclass(frozen=True, slots=True)
class Phase:
    """The tensors alive at one point of the block, by name and bytes."""

    name: str
    activation_terms: tuple[tuple[str, int], ...]
    communication_terms: tuple[tuple[str, int], ...] = ()

    @property
    def activation_bytes(self) -> int:
        return sum(b for _, b in self.activation_terms)

    @property
    def communication_bytes(self) -> int:
        return sum(b for _, b in self.communication_terms)

    @property
    def total_bytes(self) -> int:
        return self.activation_bytes + self.communication_bytes


@dataclass(frozen=True, slots=True)
class SPActivations:
    """Per-rank workload bytes of one pass at ``tokens`` over ``sp`` ranks (module docstring)."""

    dims: BlockDims
    tokens: int
    sp: int
    batch: int
    phases: tuple[Phase, ...]

    @property
    def local_tokens(self) -> int:
        return -(-self.tokens // self.sp)

    @property
    def peak_phase(self) -> Phase:
        return max(self.phases, key=lambda p: p.total_bytes)

    @property
    def activation_bytes(self) -> int:
        """``a``: the peak phase's activations (what :func:`dlo_fn.cost.hbm.hbm_per_card` takes)."""
        return self.peak_phase.activation_bytes

    @property
    def communication_bytes(self) -> int:
        """``k``: the peak phase's all-to-all send and receive buffers."""
        return self.peak_phase.communication_bytes

    @property
    def peak_bytes(self) -> int:
        return self.peak_phase.total_bytes


def sp_activations(dims: BlockDims, tokens: int, sp: int = 1, batch: int = 1) -> SPActivations:
    """The phases of the module docstring for ``tokens`` per sequence, ``sp`` ranks and ``batch`` sequences."""
    for name, value in (("tokens", tokens), ("sp", sp), ("batch", batch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if dims.num_heads % sp:
        raise ValueError(
            f"num_heads {dims.num_heads} is not divisible by sp {sp}: Ulysses SP gives each sp rank "
            f"num_heads / sp heads"
        )
    f, e = FP32_BYTES, dims.weight_itemsize
    loc = -(-tokens // sp)
    u = batch * loc * dims.hidden_dim
    mlp = batch * loc * dims.mlp_dim
    common = (
        ("rotary tables", f * tokens * dims.head_dim),
        ("inputs", f * batch * (tokens * dims.patch_dim + dims.text_len * dims.text_dim)),
        ("x0 (embedding, kept)", f * u),
        ("x (fp32 stream)", f * u),
        ("h (modulated)", f * u),
    )
    qkv = common + (("qkv", 3 * e * u),)
    phases = [Phase("qk norm + rotary", qkv + (("q", e * u), ("k.float", f * u), ("rms(k)", f * u)))]
    if sp == 1:
        phases.append(Phase("attention", qkv + (("q", e * u), ("k", e * u), ("out", e * u))))
    else:
        phases.append(
            Phase(
                "tokens -> heads",
                qkv + (("q", e * u), ("k", e * u), ("stack(q, k, v)", 3 * e * u), ("heads copy", 3 * e * u)),
                (("send", 3 * e * u), ("recv", 3 * e * u)),
            )
        )
        padded = (("padded out", e * u),) if sp * loc > tokens else ()
        send = (("send", e * u),) if batch > 1 else ()
        phases.append(
            Phase(
                "heads -> tokens",
                common + (("heads", 3 * e * u), ("out", e * u)) + padded + (("tokens copy", e * u),),
                send + (("recv", e * u),),
            )
        )
    phases.append(
        Phase("cross-attn q norm", common + (("modulated", f * u), ("q", e * u), ("q.float", f * u), ("rms(q)", f * u)))
    )
    phases.append(Phase("mlp", common + (("modulated", f * u), ("fc1", e * mlp), ("gelu", e * mlp))))
    return SPActivations(dims, tokens, sp, batch, tuple(phases))
