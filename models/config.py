"""What a model is (architecture) and how this run executes it (runtime options).

One `ModelConfig` describes every family this toolkit trains. The families
differ in a handful of switches -- normalization, position information, MLP,
biases, tied head -- that each family's record sets (models/families/); everything
else is shared. A config of a family: models.registry.make_config(family, **sizes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

@dataclass
class ModelConfig:
    # ---- architecture (saved as config.json) ----------------------------------
    family: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: Optional[int] = None  # None: same as num_attention_heads (no GQA)
    intermediate_size: int = 11008  # width of the MLP's hidden layer
    max_position_embeddings: int = 2048
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Rotary frequency scaling (models/rope.py): {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"} (Llama 3.1) or {"rope_type": "linear", "factor"};
    # None: none.
    rope_scaling: Optional[dict] = None
    initializer_range: float = 0.02
    hidden_dropout_prob: float = 0.0
    attention_probs_dropout_prob: float = 0.0

    # family switches
    norm_type: str = "rmsnorm"  # "rmsnorm" | "layernorm"
    position_embedding: str = "rope"  # "rope" | "alibi" | "learned"
    hidden_act: str = "silu"  # "silu" (SwiGLU MLP) | "gelu" | "gelu_tanh" (4h MLP)
    qkv_bias: bool = False  # bias on the q/k/v projections (Qwen v1)
    linear_bias: bool = False  # biases on every linear and norm (GPT-3, Bloom)
    tie_word_embeddings: bool = False
    embedding_layernorm: bool = False  # LayerNorm right after the word embedding (Bloom)
    norm_head: bool = False  # Baichuan2: the output head's rows are L2-normalized
    fuse_attention_qkv: bool = False  # one q/k/v projection instead of three
    fuse_attention_ffn: bool = False  # one gate/up projection instead of two
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head (one [head_dim] weight each, shared by the heads)
    # The width of one attention head when it is not hidden_size / num_attention_heads (Qwen3: 128 at every
    # size, config.json "head_dim"); None: hidden_size / num_attention_heads.
    attention_head_dim: Optional[int] = None

    # mixture of experts (models/moe.py; Mixtral, Qwen2-MoE); num_experts 0: a dense MLP
    num_experts: int = 0
    num_experts_per_tok: int = 2  # top-k
    moe_intermediate_size: Optional[int] = None  # each expert's width; None: intermediate_size
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: one always-active expert behind a sigmoid gate
    norm_topk_prob: bool = True  # renormalize the top-k routing weights to sum 1 (Mixtral yes, Qwen2-MoE no)
    router_aux_loss_coef: float = 0.001  # load-balancing loss (Switch Transformer / HF Mixtral form)
    shared_expert_gate: bool = True  # Qwen2-MoE's sigmoid gate on the shared expert (DeepSeek-V3: none)

    # DeepSeek-V3 (models/families/deepseek_v3.py); the defaults switch each piece off
    kv_lora_rank: int = 0  # > 0: multi-head latent attention (models/mla.py) instead of `Attention`
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0  # per head: the query/key part without rotation ...
    qk_rope_head_dim: int = 0  # ... the rotated part (the key's is one vector shared by the heads) ...
    v_head_dim: int = 0  # ... and the value's width
    first_k_dense_replace: int = 0  # the first k layers keep the dense MLP (intermediate_size), the rest are MoE
    # ERNIE 4.5 MoE: of the layers from first_k_dense_replace (its moe_layer_start_index) on, layer i is MoE when
    # (i + 1) % moe_layer_interval == 0 and i <= moe_layer_end_index (-1: the last layer); the others are dense
    moe_layer_interval: int = 1
    moe_layer_end_index: int = -1
    router_score: str = "softmax"  # "softmax" | "sigmoid" (DeepSeek-V3, models/deepseek_moe.py)
    # A softmax router with a correction bias that only chooses (ERNIE 4.5 MoE, models/deepseek_moe.py);
    # a sigmoid router always has one
    router_correction_bias: bool = False
    n_group: int = 1  # group-limited routing: the experts in n_group groups, tokens pick from topk_group of them
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # the routed experts' weights times this
    seq_aux_loss_coef: float = 0.0  # DeepSeek-V3's sequence-wise balance loss (report eq. 17-20)
    num_nextn_predict_layers: int = 0  # multi-token prediction depth (0 or 1)
    mtp_loss_weight: float = 0.3  # lambda of the MTP loss (DeepSeek-V3 report sec. 4.2: 0.3, later 0.1)

    # ---- runtime (set from the run's arguments; not part of config.json) -----
    seq_length: int = 1024
    tensor_parallel_degree: int = 1
    sequence_parallel: bool = False
    sep_parallel_degree: int = 1  # segment parallelism: each rank holds 1/sep of every sequence (models/parallel_layers.py)
    context_parallel_degree: int = 1  # ring attention: each rank holds 1/cp of every sequence (models/ring_attention.py)
    recompute: bool = False
    recompute_granularity: str = "full"  # "full" | "full_attn" | "core_attn"
    no_recompute_layers: list = field(default_factory=list)
    pp_recompute_interval: int = 1
    use_flash_attention: bool = False
    use_fused_rms_norm: bool = False
    use_fused_rope: bool = False
    use_fused_swiglu: bool = False  # Paddle's swiglu kernel (GPU; PaddleNLP's LLaMA MLP uses it whenever present)
    use_fast_layer_norm: bool = False  # PaddleNLP's fast_ln custom op for LayerNorm (GPU)
    router_z_loss_coef: float = 0.0  # ST-MoE router z-loss: coef x mean over tokens of logsumexp(logits)^2
    moe_capacity_factor: float = 0.0  # > 0: each expert takes at most ceil(factor x tokens x k / E); 0: dropless
    expert_parallel_degree: int = 1  # experts split over fleet's expert group (each rank: E / ep of them)
    reset_position_ids: bool = False  # packed documents: positions restart at 0 in each (models/decoder.py Documents)
    # Qwen3's global-batch load balancing (Qiu et al. 2025): the pick frequencies f_e of the load-balancing loss
    # summed over the ranks that hold other samples (data-parallel and sharding) before the loss (models/moe.py)
    moe_global_batch_balance: bool = False
    # DeepSeek-V3's auxiliary-loss-free balancing: after each optimizer step every MoE layer's correction bias
    # moves by this x sign(mean load - load) (models/deepseek_moe.py); 0: off
    moe_bias_update_rate: float = 0.0

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads

    @property
    def tokens_per_rank(self) -> int:
        """Tokens of each sequence one rank holds between the attention blocks (all of them without sep)."""
        return self.seq_length // (self.sep_parallel_degree * self.context_parallel_degree)

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def q_size(self) -> int:
        """Width of the query projection's output (hidden_size unless head_dim is set apart, Qwen3)."""
        return self.num_attention_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer_index: int) -> bool:
        """Whether decoder layer `layer_index` has the mixture of experts (DeepSeek-V3: not the first k; ERNIE 4.5:
        also every moe_layer_interval-th up to moe_layer_end_index, as Ernie4_5_MoeDecoderLayer.__init__)."""
        return (self.is_moe and layer_index >= self.first_k_dense_replace
                and (layer_index + 1) % self.moe_layer_interval == 0
                and (self.moe_layer_end_index < 0 or layer_index <= self.moe_layer_end_index))

    @property
    def moe_layer_count(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    @property
    def router_count(self) -> int:
        """The routers a forward reports statistics of: the MoE decoder layers and the multi-token-prediction
        block's when it is one (models/decoder.py MTPLayer: decoder layer num_hidden_layers)."""
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers + self.num_nextn_predict_layers))

    @property
    def has_correction_bias(self) -> bool:
        """The router chooses on scores + e_score_correction_bias (models/deepseek_moe.py)."""
        return self.is_moe and (self.router_score == "sigmoid" or self.router_correction_bias)

    @property
    def uses_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def uses_swiglu(self) -> bool:
        return self.hidden_act == "silu"

    def architecture_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in RUNTIME_KEYS}

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


RUNTIME_KEYS = (
    "seq_length", "tensor_parallel_degree", "sequence_parallel", "sep_parallel_degree", "context_parallel_degree", "recompute", "recompute_granularity",
    "no_recompute_layers", "pp_recompute_interval", "use_flash_attention", "use_fused_rms_norm", "use_fused_rope",
    "use_fused_swiglu", "use_fast_layer_norm", "router_z_loss_coef", "moe_capacity_factor", "expert_parallel_degree",
    "reset_position_ids",
    "moe_global_batch_balance", "moe_bias_update_rate",
)


def recomputes(config: ModelConfig, granularity: str, layer_index: int) -> bool:
    """Whether decoder layer `layer_index` recomputes the part named by `granularity` in backward (here, not in
    models/decoder.py, so that the latent attention of models/mla.py, which the decoder imports, can ask too)."""
    return (config.recompute and config.recompute_granularity == granularity
            and layer_index not in config.no_recompute_layers)
