"""DeepSeek-V3's (and ERNIE 4.5's) mixture of experts: models/moe.py's MoE with its router, its balancing and an ungated shared expert.

    scores   = sigmoid(x W_router)                                   [tokens, E], float32
    choice   = scores + e_score_correction_bias                       (the bias only chooses)
    groups   = the E experts in n_group groups; a group's score is the sum of its two best choices;
               each token keeps its topk_group best groups, the other experts' choices become 0
    top-k    = the k best choices (ties: the lower expert index)
    weights  = the chosen experts' scores (without the bias), / their sum (norm_topk_prob), x routed_scaling_factor
    y        = sum_j weights_j expert_{e_j}(x) + shared_expert(x)

As PaddleFormers 0.4.1 DeepseekV2TopkRouter / DeepseekV2MoE (paddleformers/transformers/deepseek_v2/modeling.py,
which DeepseekV3ForCausalLM uses) and the DeepSeek-V3 report (arXiv 2412.19437) sec. 2.1.2.

ERNIE 4.5 MoE (models/families/ernie4_5_moe.py: router_score "softmax", router_correction_bias) is the same block
with softmax scores, one group, scaling 1 and the sum clipped at 1e-12 (moe_norm_min) instead of + 1e-20:

    scores   = softmax(x W_router);  choice = scores + e_score_correction_bias;  top-k of the choice
    weights  = the chosen scores / max(their sum, 1e-12);  y = sum_j weights_j expert_{e_j}(x) + shared_expert(x)

as transformers' Ernie4_5_MoeTopKRouter / Ernie4_5_MoeSparseMoeBlock (models/ernie4_5_moe/modeling_ernie4_5_moe.py,
5.24.0; 4.57.6 the same in Ernie4_5_MoeSparseMoeBlock.forward) and PaddleFormers 0.4.1's
nn/moe/moe_allgather_layer.py fused_gate_logits_process_fused.

Auxiliary-loss-free balancing (report sec. 2.1.2): each training forward adds its expert picks to the layer's
`step_load`; after each optimizer step `update_correction_bias` moves the bias by rate x sign(mean load - load)
(the load summed over the data-parallel and sharding ranks first, so every rank moves it alike) and clears the
count. The bias is a parameter that takes no gradient (stop_gradient, as PaddleFormers' MoEGate), so that
checkpoints carry it; the optimizer never sees a gradient for it.

Sequence-wise balance loss (report eq. 17-20), per layer, its mean over the sequences of the micro-batch:
    sum_e f_e P_e,  f_e = E / (k T) x picks of e in the sequence,  P_e = mean over the sequence of s'_e,
    s' = scores / their sum over the experts;  x seq_aux_loss_coef (models/decoder.py add_router_losses)
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F

from models import parallel_layers as pl
from models.config import ModelConfig
from models.moe import MoE, RouterStats


class DeepSeekMoE(MoE):
    def __init__(self, config: ModelConfig, mlp_class):
        super().__init__(config, mlp_class)
        self.e_score_correction_bias = self.create_parameter(
            [config.num_experts], dtype="float32", default_initializer=paddle.nn.initializer.Constant(0.0))
        self.e_score_correction_bias.stop_gradient = True
        self.step_load = paddle.zeros([config.num_experts], dtype="float32")  # picks since the last update
        self._seq = 1

    def forward(self, hidden):
        # the length of a sequence, for the sequence-wise loss (under sequence parallelism `hidden` is this rank's
        # chunk of the flattened tokens; the router sees every token of the micro-batch)
        self._seq = self.config.tokens_per_rank if hidden.ndim == 2 else hidden.shape[1]
        out = super().forward(hidden)
        if self.training:
            self.step_load = self.step_load + self.last_stats.picks
        return out

    def route(self, x):
        c = self.config
        tokens, experts, k = x.shape[0], c.num_experts, c.num_experts_per_tok
        logits = self.gate(x).astype("float32")
        softmax = c.router_score == "softmax"  # ERNIE 4.5; DeepSeek-V3: sigmoid
        scores = F.softmax(logits, axis=-1) if softmax else F.sigmoid(logits)
        with paddle.no_grad():
            choice = scores.detach() + self.e_score_correction_bias.unsqueeze(0)
            if c.n_group > 1:
                per_group = choice.reshape([tokens, c.n_group, experts // c.n_group])
                group_scores = paddle.topk(per_group, 2, axis=-1)[0].sum(axis=-1)
                groups = paddle.argsort(group_scores, axis=-1, descending=True, stable=True)[:, :c.topk_group]
                group_mask = paddle.put_along_axis(paddle.zeros_like(group_scores), groups, paddle.ones_like(
                    group_scores[:, :c.topk_group]), axis=-1)
                expert_mask = group_mask.unsqueeze(-1).expand(per_group.shape).reshape([tokens, experts])
                # the other groups' experts at 0, not -inf, as PaddleFormers' (and transformers') masked_fill(.., 0.0)
                choice = choice * expert_mask
            selected = paddle.argsort(choice, axis=-1, descending=True, stable=True)[:, :k]
        weights = paddle.take_along_axis(scores, selected, axis=-1)
        if c.norm_topk_prob:
            total = weights.sum(axis=-1, keepdim=True)
            weights = weights / (paddle.clip(total, min=1e-12) if softmax else total + 1e-20)
        if c.routed_scaling_factor != 1.0:
            weights = weights * c.routed_scaling_factor
        one_hot = F.one_hot(selected.flatten(), experts)  # [tokens x k, E]
        normalized = scores / scores.sum(axis=-1, keepdim=True)
        z_sum = (paddle.logsumexp(logits, axis=-1) ** 2).sum() if c.router_z_loss_coef else paddle.zeros([])
        stats = RouterStats(picks=one_hot.sum(axis=0).detach(), prob_sum=normalized.sum(axis=0), z_sum=z_sum,
                            dropped=paddle.zeros([], dtype="int64"), tokens=tokens,
                            seq_balance=self.sequence_balance(one_hot, normalized))
        return selected, weights.astype(x.dtype), stats

    def sequence_balance(self, one_hot, normalized):
        """The sequence-wise balance loss (unscaled), mean over the micro-batch's sequences. Under sep / cp each
        rank routes part of every sequence: each sequence's picks and score sums are added over the sep group
        first (pl.sum_over_segments, as the router's other statistics: models/moe.py whole_sequence_stats), so
        that every rank computes one process's loss."""
        c = self.config
        experts, k, seq = c.num_experts, c.num_experts_per_tok, self._seq
        picks = one_hot.reshape([-1, seq * k, experts]).sum(axis=1).detach()
        score_sums = normalized.reshape([-1, seq, experts]).sum(axis=1)
        if pl.splits_sequence(c):
            sums = pl.sum_over_segments(c, paddle.concat([picks, score_sums], axis=-1))
            picks, score_sums = sums[:, :experts].detach(), sums[:, experts:]
            seq *= c.sep_parallel_degree * c.context_parallel_degree
        f = picks * experts / (k * seq)
        return (f * score_sums / seq).sum(axis=-1).mean()

    @paddle.no_grad()
    def update_correction_bias(self, rate: float) -> None:
        """bias += rate x sign(mean load - load), the load of the step's global batch; the count restarts."""
        load, _ = pl.sum_over_data_replicas(self.step_load)
        self.e_score_correction_bias.set_value(self.e_score_correction_bias + rate * paddle.sign(load.mean() - load))
        self.step_load = paddle.zeros_like(self.step_load)
