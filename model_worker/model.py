"""Our torch implementation of Llama-family decoders (Llama, SmolLM, Mistral, Qwen2) over the paged KV pool.

Numerics mirror transformers' modeling_llama / modeling_qwen2 so that greedy outputs match: RMSNorm in float32 then
`weight * hidden.to(input_dtype)`, RoPE cos/sin computed in float32 then cast to the activation dtype, SiLU(gate) *
up. Two fusions halve the GEMM calls: q/k/v are one projection (`qkv_proj`) and gate/up another (`gate_up_proj`),
their weights concatenated at load (`fuse_projections`); each output column is the same dot product as HF's. RoPE
rotates q and k in one pass with a sine table whose first half is negated (`rope_tables`), which is HF's
`x * cos + rotate_half(x) * sin` exactly. Other module names equal HF's.
The linear kernel is chosen once at load (`linear_class`) and sums in another order than HF's: with `kernels` (float32
on a CPU where `model_worker.cpu_kernels` builds) `KernelLinear` (one FMA chain per output at every row count),
else float32 on a CPU `PackedLinear` (oneDNN), both with logits within ~1e-4 of HF's, and bfloat16 on a CPU without
native bf16 GEMM `UpcastLinear`. With `kernels`, the norms, the residual sums, SiLU-times-up and RoPE also run as
fused kernels (`KernelRMSNorm`, `MLP.kernels`, `Attention.kernel_rope`); the norms and SiLU round differently from
torch's (~1e-6), never by batch, and RoPE is torch's bit for bit.

Each residual sum is fused with the norm after it (`RMSNorm.add_forward`: residual += sublayer output, then the norm
of it), as the layer's next sublayer or the final norm needs it:

    residual = embed(ids); hidden = layer 0's input norm(residual)
    per layer:  hidden, residual = post-attention norm.add_forward(attention(hidden), residual)
                hidden, residual = (next layer's input norm or the final norm).add_forward(mlp(hidden), residual)

With the fused CPU kernels on their paged attention backend, a layer is one op (`DecoderLayer.fused_forward`):
the same kernels in the same order, without the ~25 Python-level calls of the layer-by-layer path.

Tokens of several sequences are flattened: `forward(input_ids [T], positions [T], meta, logits_rows [N])` returns
float32 logits [N, vocab] for the chosen rows only (the last token of each sequence that samples this step).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from model_worker.attention import AttentionBackend, PagedCpuBackend, PagedMetadata
from model_worker.huge_pages import on_huge_pages

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelShape:
    """What the engine needs to know about a model, read once from its HF config."""

    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool

    @classmethod
    def from_config(cls, config: Any) -> "ModelShape":
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {config.model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
        is_qwen2 = config.model_type == "qwen2"
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            model_type=config.model_type,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,  # Qwen2: bias on q/k/v only
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
        )


def rope_parameters(config: Any) -> dict[str, Any]:
    """RoPE settings from a transformers-5 config (`rope_parameters`) or an older one (`rope_theta`, `rope_scaling`)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def rope_tables(config: Any, head_dim: int, max_positions: int, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, signed sin [max_positions, head_dim] computed in float32 like HF's rotary embedding, then cast to
    `dtype`; the sine's first half is negated, so that `x * cos + x.roll(head_dim // 2, -1) * sin` is HF's
    `x * cos + rotate_half(x) * sin` (negation is exact)."""
    params = rope_parameters(config)
    scaling = 1.0
    if params["rope_type"] == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / head_dim
        inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, device)
    positions = torch.arange(max_positions, device=device, dtype=torch.float)
    freqs = positions[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin() * scaling
    sin[:, :head_dim // 2].neg_()
    return (emb.cos() * scaling).to(dtype), sin.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """HF's `weight * (x * rsqrt(mean(x^2) + eps)).to(input_dtype)` with x in float32; torch's fused rms_norm
        computes the normalisation bit for bit as HF's four ops do (checked in float32 and bfloat16), and in
        float32 multiplies by the weight inside, bit for bit as the separate product (one pass fewer)."""
        if hidden.dtype == torch.float32:
            return F.rms_norm(hidden, self.weight.shape, self.weight, self.eps)
        normalized = F.rms_norm(hidden.to(torch.float32), self.weight.shape, eps=self.eps)
        return self.weight * normalized.to(hidden.dtype)

    def add_forward(self, fresh: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + fresh), residual + fresh): a sublayer's output `fresh` (which this may overwrite) added
        to the residual stream, and the next sublayer's input; HF's `hidden = residual + hidden`, bit for bit."""
        residual = fresh.add_(residual)
        return self(residual), residual


class KernelRMSNorm(RMSNorm):
    """RMSNorm in float32 through the fused CPU kernels: one pass for the norm, one for the residual sum and the
    norm together (`add_forward` updates `residual` in place and writes the norm over `fresh`)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.ops.radixserve.rms_norm(hidden, self.weight, self.eps)

    def add_forward(self, fresh: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        torch.ops.radixserve.add_rms_norm_(fresh, residual, self.weight, self.eps)
        return fresh, residual


def norm_class(kernels: bool) -> type[RMSNorm]:
    """`KernelRMSNorm` with the fused CPU kernels, else `RMSNorm`."""
    return KernelRMSNorm if kernels else RMSNorm


class UpcastLinear(nn.Linear):
    """A bfloat16 Linear for CPUs without native bf16 GEMM (no AVX512-BF16/AMX).

    There, torch's bf16 GEMV (one row) is fast but its bf16 GEMM is emulated and scales with the row count (8 rows:
    6x slower than float32). Beyond `GEMV_ROWS` rows this computes in float32 — bf16 products are exact in float32
    and the bf16 kernel also accumulates in float32 — then rounds to bf16; only the summation order differs.
    """

    GEMV_ROWS = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.GEMV_ROWS:
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)


class PackedLinear(nn.Linear):
    """A float32 Linear on a CPU with oneDNN: every row count multiplies by the weight packed once into oneDNN's
    layout (`pack`, which `load_model` calls). The plain weight is kept (tied embeddings, tests), so the weights
    take twice the memory.

    Measured on the model's shapes, 2 cores, a whole step's linears (lm_head included): on AMD EPYC (Zen 4) MKL's
    GEMV at one row takes 48-55 ms against 22-31 ms packed, and MKL's GEMM at 112 rows 292 against 156 ms (decode
    of one sequence: 74-80 against 51-56 ms a step); on Intel Xeons MKL was 7-18% faster at one row and up to 15% at
    two, 1.2-1.4x slower at 4-8 rows and about equal at 128-512. One kernel at every row count keeps a sequence's K/V
    independent of its batch. docs/design.md section 9.
    """

    packed: torch.Tensor

    def pack(self) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class KernelLinear(PackedLinear):
    """A float32 Linear through the fused CPU kernels (`torch.ops.radixserve.linear`): the weight packed once
    (`pack`) into panels of 16 output columns, each output one FMA chain over the inputs in order whatever the row
    count or vector width, so every row is bit for bit the same in a decode step of 1 and in a prefill of 2,000,
    `down_proj` included (oneDNN's one-row GEMV sums that one in another order). The plain weight is kept, as
    `PackedLinear`'s.

    Measured against `PackedLinear` on the model's shapes (30 layers' four projections, 2 cores, AMD EPYC Zen 4,
    min of 10, alternating): 1 row 12.9-15.1 vs 21.2-24.7 ms, 4 rows 15.1-16.7 vs 23.1-27.3, 48 rows 59 vs 69,
    112 rows 142 vs 148, 512 rows 518 vs 545 (docs/design.md section 9).
    """

    def pack(self) -> None:
        self.packed = torch.ops.radixserve.pack_linear_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.radixserve.linear(x, self.packed, self.out_features, self.bias)


class KernelGateUpSilu(KernelLinear):
    """The MLP's fused gate/up projection through the fused CPU kernels, with its SiLU-times-up: `forward` returns
    silu(gate) * up ([rows, intermediate]) of `torch.ops.radixserve.gate_up_silu`, `KernelLinear`'s gate and up
    columns (the same FMA chains) with the SiLU applied to each tile while it is in the cache: the
    [rows, 2 x intermediate] product never goes to memory (a 1,328-token prefill's separate SiLU pass
    took 54 of ~800 ms on AMD EPYC Zen 5)."""

    def pack(self) -> None:
        self.packed = torch.ops.radixserve.pack_gate_up_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.radixserve.gate_up_silu(x, self.packed, self.out_features // 2, self.bias)


def cpu_supports_bf16() -> bool:
    """Whether this CPU has native bfloat16 matrix instructions (AVX512-BF16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def linear_class(dtype: torch.dtype, device: torch.device, kernels: bool = False) -> type[nn.Linear]:
    """`KernelLinear` with the fused CPU kernels (float32, loaded), else `PackedLinear` for float32 on a CPU with
    oneDNN, `UpcastLinear` for bfloat16 on a CPU without native bf16 GEMM, else `nn.Linear` (HF's exact kernels)."""
    if kernels:
        return KernelLinear
    if device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available():
        return PackedLinear
    emulated_bf16 = dtype == torch.bfloat16 and device.type == "cpu" and not cpu_supports_bf16()
    return UpcastLinear if emulated_bf16 else nn.Linear


@dataclass(frozen=True)
class StepRope:
    """RoPE of one forward's tokens: the tables (`rope_tables`) and each token's position; `rows` are the tables'
    rows at those positions, [T, 1, D] each, gathered once a forward for torch's ops."""

    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor

    @functools.cached_property
    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[self.positions][:, None, :], self.sin[self.positions][:, None, :]


class Attention(nn.Module):
    def __init__(self, shape: ModelShape, layer: int, linear: type[nn.Linear], kernels: bool) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.qkv_proj = linear(shape.hidden_size, (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim,
                               bias=shape.qkv_bias)
        self.o_proj = linear(shape.num_heads * shape.head_dim, shape.hidden_size, bias=shape.o_bias)
        self.kernel_rope = kernels and shape.head_dim % 16 == 0  # `rope_` works on 16-float halves of 8 lanes

    def forward(self, hidden: torch.Tensor, rope: StepRope, backend: AttentionBackend, meta: Any) -> torch.Tensor:
        tokens, rotated = hidden.shape[0], self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(hidden).view(tokens, rotated + self.num_kv_heads, self.head_dim)
        if self.kernel_rope:
            torch.ops.radixserve.rope_(qkv, rope.cos, rope.sin, rope.positions, rotated)
            qk = qkv
        else:
            cos, sin = rope.rows
            qk = qkv[:, :rotated]
            qk = qk.roll(self.head_dim // 2, -1).mul_(sin).add_(qk * cos)  # in place on the roll's copy: same bits
        q, k, v = qk[:, :self.num_heads], qk[:, self.num_heads:rotated], qkv[:, rotated:]
        return self.o_proj(backend.attend(self.layer, q, k, v, meta))


class MLP(nn.Module):
    def __init__(self, shape: ModelShape, linear: type[nn.Linear], kernels: bool) -> None:
        super().__init__()
        gate_up = KernelGateUpSilu if kernels else linear  # kernels: `linear` is KernelLinear
        self.gate_up_proj = gate_up(shape.hidden_size, 2 * shape.intermediate_size, bias=shape.mlp_bias)
        self.down_proj = linear(shape.intermediate_size, shape.hidden_size, bias=shape.mlp_bias)
        self.kernels = kernels

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.kernels:
            return self.down_proj(self.gate_up_proj(hidden))  # SiLU-times-up included
        gate, up = self.gate_up_proj(hidden).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape, layer: int, linear: type[nn.Linear], kernels: bool) -> None:
        super().__init__()
        norm = norm_class(kernels)
        self.self_attn = Attention(shape, layer, linear, kernels)
        self.mlp = MLP(shape, linear, kernels)
        self.input_layernorm = norm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = norm(shape.hidden_size, shape.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor, next_norm: RMSNorm, rope: StepRope,
                backend: AttentionBackend, meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden` is this layer's normed input; returns `next_norm`'s input and the residual stream after it."""
        hidden, residual = self.post_attention_layernorm.add_forward(
            self.self_attn(hidden, rope, backend, meta), residual)
        return next_norm.add_forward(self.mlp(hidden), residual)

    def fused_forward(self, hidden: torch.Tensor, residual: torch.Tensor, next_norm: RMSNorm, rope: StepRope,
                      backend: PagedCpuBackend, meta: PagedMetadata,
                      rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` in one call of `torch.ops.radixserve.decoder_layer`, the same kernels in the same order, so bit
        for bit its result: for a layer of `KernelLinear`s and kernel norms over the paged CPU backend. It saves the
        ~25 Python-level calls a layer costs (~4 ms of a 4-sequence decode step, 30 layers). With `rows` (strictly
        increasing), every token's K/V is written but only those rows are returned (the residual then unchanged)."""
        attention, mlp, pool = self.self_attn, self.mlp, backend.pool
        hidden = torch.ops.radixserve.decoder_layer(
            hidden, residual, attention.qkv_proj.packed, attention.qkv_proj.bias, attention.o_proj.packed,
            attention.o_proj.bias, self.post_attention_layernorm.weight, mlp.gate_up_proj.packed,
            mlp.gate_up_proj.bias, mlp.down_proj.packed, mlp.down_proj.bias, next_norm.weight, next_norm.eps,
            rope.cos, rope.sin, rope.positions, attention.num_heads, pool.k_layers[attention.layer],
            pool.v_layers[attention.layer], meta.write_pages, meta.write_offsets, meta.block_tables, meta.starts,
            meta.lengths, backend.scale, rows)
        return hidden, residual


class DecoderBody(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, shape: ModelShape, linear: type[nn.Linear], kernels: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape, i, linear, kernels) for i in range(shape.num_layers))
        self.norm = norm_class(kernels)(shape.hidden_size, shape.rms_norm_eps)


class CausalLM(nn.Module):
    """A Llama-family decoder reading and writing K/V through an `AttentionBackend`; `kernels`: the fused CPU
    kernels of `model_worker.cpu_kernels` (float32, loaded) for its norms, RoPE and SiLU."""

    def __init__(self, shape: ModelShape, linear: type[nn.Linear] = nn.Linear, kernels: bool = False) -> None:
        super().__init__()
        self.shape = shape
        self.model = DecoderBody(shape, linear, kernels)
        self.lm_head = linear(shape.hidden_size, shape.vocab_size, bias=False)
        self.kernels = kernels
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None
        self.fused_layers = False

    def bind(self, backend: AttentionBackend, rope: tuple[torch.Tensor, torch.Tensor],
             fused_layers: bool = True) -> None:
        """Attaches the attention backend and the precomputed RoPE tables; call once before `forward`. With the
        fused CPU kernels and their paged backend, each layer runs as one call (`DecoderLayer.fused_forward`)
        unless `fused_layers` is False."""
        self.backend = backend
        self.rope_cos, self.rope_sin = rope
        self.fused_layers = (fused_layers and self.kernels and isinstance(backend, PagedCpuBackend)
                             and self.model.layers[0].self_attn.kernel_rope)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any,
                logits_rows: torch.Tensor) -> torch.Tensor:
        """Runs all layers over the flat tokens; float32 logits [len(logits_rows), vocab] (strictly increasing
        rows). Fused, the last layer goes past its K/V only for the logits rows: the other rows' outputs there feed
        nothing (a 2,048-token prefill: one row's attention and MLP instead of 2,048, ~3% of it)."""
        rope = StepRope(self.rope_cos, self.rope_sin, positions)
        layers = self.model.layers
        residual = self.model.embed_tokens(input_ids)
        hidden = layers[0].input_layernorm(residual)
        only_logits_rows = self.fused_layers and len(logits_rows) < len(input_ids)
        for layer, next_layer in zip(layers, [*layers[1:], None]):
            next_norm = self.model.norm if next_layer is None else next_layer.input_layernorm
            if self.fused_layers:
                rows = logits_rows if next_layer is None and only_logits_rows else None
                hidden, residual = layer.fused_forward(hidden, residual, next_norm, rope, self.backend, meta, rows)
            else:
                hidden, residual = layer(hidden, residual, next_norm, rope, self.backend, meta)
        return self.lm_head(hidden if only_logits_rows else hidden[logits_rows]).float()


def load_model(model_dir: Path, config: Any, dtype: torch.dtype, device: torch.device,
               kernels: bool = False) -> CausalLM:
    """Builds the model without random init and loads the safetensors weights of `model_dir`, cast to `dtype`;
    `kernels` as `CausalLM`'s."""
    shape = ModelShape.from_config(config)
    with torch.device("meta"):
        model = CausalLM(shape, linear_class(dtype, device, kernels), kernels)
    state: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(file, device=str(device)))
    if "lm_head.weight" not in state:
        if not shape.tie_word_embeddings:
            raise ValueError(f"{model_dir}: no lm_head.weight and tie_word_embeddings is false")
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    state = {name: tensor.to(dtype) for name, tensor in fuse_projections(state).items()}
    model.load_state_dict(state, strict=True, assign=True)
    if shape.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval().requires_grad_(False)
    linears = [module for module in model.modules() if isinstance(module, PackedLinear)]
    for module in linears:
        module.pack()
    if kernels:  # every linear is a KernelLinear; what every step streams, on huge pages (model_worker.huge_pages)
        for module, packed in zip(linears, on_huge_pages([module.packed for module in linears]), strict=True):
            module.packed = packed
    return model


FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fuse_projections(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An HF state dict with each layer's q/k/v and gate/up weights (and biases) concatenated, output rows in that
    order, under the fused modules' names (`FUSED`)."""
    state = dict(state)
    for name in [n for n in state if n.endswith(".self_attn.q_proj.weight")]:
        layer = name.removesuffix("self_attn.q_proj.weight")
        for fused, parts in FUSED.items():
            for kind in ("weight", "bias"):
                names = [f"{layer}{part}.{kind}" for part in parts]
                if names[0] in state:
                    state[f"{layer}{fused}.{kind}"] = torch.cat([state.pop(n) for n in names])
    return state
