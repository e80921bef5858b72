"""CausalLM: the decoder stack and its paged forward pass (the serving engine's entry point)."""

from __future__ import annotations

import torch
from torch import nn

from compute_service import kernels
from compute_service.kernels import linear_cpu
from compute_service.model.attention import PagedAttention
from compute_service.model.batch import (
    ForwardBatch,
    ForwardMode,
    ForwardOutput,
    MambaBoundaryStates,
)
from compute_service.model.config import ATTENTION, MAMBA, MLP, PARALLEL, ModelConfig
from compute_service.model.layers import RMSNorm, RotaryEmbedding, build_mlp
from compute_service.model.mamba import BoundarySelection, Mamba2Mixer, select_boundaries
from compute_service.model.moe import SparseMoE

# Parameters kept in fp32 whatever the model dtype (see CausalLM.cast).
FP32_PARAMS = ("A_log", "D", "dt_bias")
# Projections of one input computed together by `kernels.linear_group` (CausalLM.join_projections).
_JOINED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class DecoderLayer(nn.Module):
    """h += mixer(norm1(h)); h += mlp(norm2(h)) (the MLP half only when `cfg.mixer_mlp` or
    the layer is in moe_layer_ids, where `mlp` is the sparse MoE block; with
    `cfg.moe_shared_mlp` (Granite) `mlp` stays the dense MLP, a shared expert, and the sparse
    block is `moe` beside it: h += mlp(x) + moe(x), x = norm2(h)).
    An "mlp" layer (NemotronH) is h += mlp(norm1(h)): attn, mamba and norm2 are None. A
    "parallel" layer (Falcon-H1) has both mixers: h += mamba(norm1(h)) + attn(norm1(h))."""

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        kind = cfg.layer_types[layer_id]
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn: PagedAttention | None = None
        self.mamba: Mamba2Mixer | None = None
        if kind in (ATTENTION, PARALLEL):
            self.attn = PagedAttention(cfg, cfg.sliding_windows[layer_id])
        if kind in (MAMBA, PARALLEL):
            self.mamba = Mamba2Mixer(cfg)
        self.mlp: nn.Module | None = None
        self.moe: SparseMoE | None = None
        if layer_id in cfg.moe_layer_ids:
            sparse = SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.moe_num_experts,
                               cfg.moe_top_k, cfg.moe_renormalize, cfg.moe_routing)
            if cfg.moe_shared_mlp:
                self.mlp, self.moe = build_mlp(cfg), sparse
            else:
                self.mlp = sparse
        elif cfg.mixer_mlp or kind == MLP:
            self.mlp = build_mlp(cfg)
        has_norm2 = self.mlp is not None and kind != MLP
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if has_norm2 else None


class CausalLM(nn.Module):
    """Embedding -> DecoderLayer x num_layers -> final RMSNorm -> LM head (tied or not).

    Parameter names (the `state_dict` keys, see `checkpoint.py` for the HF mapping):
    `embed.weight`, `layers.{i}.norm1.weight`, `layers.{i}.attn.{q,k,v,o}_proj.{weight,bias}`,
    `layers.{i}.attn.{q,k}_norm.weight` (qk_norm),
    `layers.{i}.mamba.{in_proj,out_proj}.{weight,bias}`, `layers.{i}.mamba.{conv_weight,
    conv_bias,dt_bias,A_log,D}`, `layers.{i}.mamba.norm.weight`, `layers.{i}.norm2.weight`,
    `layers.{i}.mlp.{gate,up,down}_proj.{weight,bias}` (dense) or `layers.{i}.mlp.gate.weight`,
    `layers.{i}.mlp.experts.{gate_up_proj,down_proj}` (MoE, see `moe.py`; `layers.{i}.moe.`
    instead where the dense `mlp` is kept as a shared expert), `final_norm.weight`,
    `lm_head.weight` (absent when tied).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cfg.validate()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        self.rotary = RotaryEmbedding(cfg) if cfg.attention_layer_ids and cfg.use_rope else None

    @classmethod
    def empty(cls, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> CausalLM:
        """A model with uninitialised parameters (to be loaded into), built without running the
        default initialisers, with parameter dtypes as `cast` gives them."""
        with torch.device("meta"):
            model = cls(cfg)
        model.to_empty(device=device)
        # to_empty leaves non-persistent buffers uninitialised: rebuild the RoPE table.
        if model.rotary is not None:
            model.rotary = RotaryEmbedding(cfg).to(device)
        model.cast(dtype)
        if torch.device(device).type == "cuda":
            model.join_projections()
        return model

    def join_projections(self) -> CausalLM:
        """Lays the weights of the projections that read the same input (q/k/v, gate/up) end
        to end in one buffer each, every Linear's weight a view of its rows, so that
        `kernels.linear_group` runs each group as one GEMM (one launch instead of three or two,
        and a wider GEMM). Done before weights are loaded: loaders copy into the views. Groups
        with biases are left apart (their GEMM would need the biases joined on every call)."""
        for module in self.modules():
            for names in _JOINED_PROJECTIONS:
                linears = [getattr(module, n, None) for n in names]
                if not all(isinstance(lin, nn.Linear) and lin.bias is None for lin in linears):
                    continue
                first = linears[0].weight
                if any(lin.weight.shape[1] != first.shape[1] or lin.weight.dtype != first.dtype
                       for lin in linears):
                    continue
                joined = torch.empty(sum(lin.weight.shape[0] for lin in linears), first.shape[1],
                                     dtype=first.dtype, device=first.device)
                row = 0
                for lin in linears:
                    rows = lin.weight.shape[0]
                    joined[row:row + rows].copy_(lin.weight.data)
                    lin.weight = nn.Parameter(joined[row:row + rows],
                                              requires_grad=lin.weight.requires_grad)
                    row += rows
        return self

    def cast(self, dtype: torch.dtype) -> CausalLM:
        """Convert parameters to `dtype`, except the Mamba A_log, D and dt_bias, which stay fp32
        (they feed exponentials of the recurrence; HF keeps them in the model dtype, a
        difference of rounding only)."""
        for name, p in self.named_parameters():
            target = torch.float32 if name.rsplit(".", 1)[-1] in FP32_PARAMS else dtype
            p.data = p.data.to(target)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
    ) -> ForwardOutput:
        """Run T new tokens of B sequences through the paged caches.

        input_ids [T] int64, positions [T] int64 (positions[cu_seqlens_q[b] + j] must equal
        prefix_lens[b] + j). Writes the new tokens' K/V into `batch.kv_caches` and advances the
        Mamba slots `batch.state_indices` in `batch.mamba_states`. Returns fp32 logits of
        `batch.selected_indices()` and, when `batch.mamba_checkpoint_interval > 0` in EXTEND mode
        and the model has Mamba layers, the states at every page boundary inside the call.
        """
        cfg = self.config
        n_attn, n_mamba = len(cfg.attention_layer_ids), len(cfg.mamba_layer_ids)
        if len(batch.kv_caches) != n_attn:
            raise ValueError(
                f"kv_caches: {len(batch.kv_caches)} pairs for {n_attn} attention layers"
            )
        if len(batch.mamba_states) != n_mamba:
            raise ValueError(
                f"mamba_states: {len(batch.mamba_states)} pairs for {n_mamba} Mamba layers"
            )
        if batch.mode is ForwardMode.DECODE and input_ids.shape[0] != batch.batch_size:
            raise ValueError("DECODE mode needs exactly one new token per sequence")
        if batch.lora is not None and len(batch.lora.layers) != cfg.num_layers:
            raise ValueError(f"lora: {len(batch.lora.layers)} layers for {cfg.num_layers} layers")

        stream_dtype = torch.float32 if cfg.residual_in_fp32 else self.dtype
        h = self.embed_tokens(input_ids).to(stream_dtype)
        if cfg.embedding_multiplier != 1.0:
            h = h * cfg.embedding_multiplier
        cos_sin = self.rotary(positions, self.dtype) if self.rotary is not None else None
        seq_lens = batch.seq_lens() if batch.mode is ForwardMode.DECODE else None
        boundaries: BoundarySelection | None = None
        if (
            batch.mode is ForwardMode.EXTEND
            and batch.mamba_checkpoint_interval > 0
            and cfg.mamba_layer_ids
        ):
            boundaries = select_boundaries(batch, cfg.mamba_chunk_size)
        ssm_out: list[torch.Tensor] = []
        conv_out: list[torch.Tensor] = []
        attn_i = mamba_i = 0
        for i, layer in enumerate(self.layers):
            lora = batch.lora.layers[i] if batch.lora is not None else None
            x = layer.norm1(h.to(self.dtype))
            if layer.attn is None and layer.mamba is None:  # an "mlp" layer
                h = self._residual(h, layer.mlp(x, lora))
                continue
            branch = None
            if layer.mamba is not None:
                branch, states = layer.mamba(x, batch, batch.mamba_states[mamba_i], boundaries, lora)
                mamba_i += 1
                if states is not None:
                    ssm_out.append(states[0])
                    conv_out.append(states[1])
            if layer.attn is not None:  # beside the Mamba2 mixer in a "parallel" layer
                a = layer.attn(x, cos_sin, batch, batch.kv_caches[attn_i], seq_lens, lora)
                attn_i += 1
                branch = a if branch is None else branch + a
            x = branch
            h = self._residual(h, x)
            if layer.norm2 is not None:
                x = layer.norm2(h.to(self.dtype))
                y = layer.mlp(x, lora)
                h = self._residual(h, y if layer.moe is None else layer.moe(x) + y)

        selected = h[batch.selected_indices()]
        logits = self.logits(self.final_norm(selected))
        mamba_boundaries = None
        if boundaries is not None:
            mamba_boundaries = MambaBoundaryStates(
                boundaries.seq_index, boundaries.positions, ssm_out, conv_out
            )
        return ForwardOutput(logits=logits, mamba_boundaries=mamba_boundaries)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of `input_ids`; from the packed copy when a CPU warm-up released
        a tied embedding into it (compute_service/model/warmup.py)."""
        if linear_cpu.is_released(self.embed.weight):
            return linear_cpu.packed_rows(self.embed.weight, input_ids)
        return self.embed(input_ids)

    def _residual(self, h: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        m = self.config.residual_multiplier
        return h + (branch if m == 1.0 else branch * m)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden [K, hidden] -> fp32 logits [K, vocab] (divided by
        `logits_scaling`, Granite's muP output multiplier)."""
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        logits = kernels.linear(normed.to(weight.dtype), weight).float()
        s = self.config.logits_scaling
        return logits if s == 1.0 else logits / s
