"""The mixture-of-experts MLP (Mixtral, Qwen2-MoE): a router sends each token to k of E experts.

    probs   = softmax(x W_router)                       [tokens, E], float32
    top-k   = the k largest probs; ties go to the lower expert index (a stable sort: the same
              choice in every layout, whatever the batch size the router saw)
    weights = top-k probs, renormalized to sum 1 if norm_topk_prob (Mixtral) or not (Qwen2-MoE)
    y       = sum_j weights_j * expert_{e_j}(x)  [+ sigmoid(x w_shared_gate) * shared_expert(x)]

Every expert is the decoder's SwiGLU MLP at width moe_intermediate_size (split like the dense MLP
under tensor parallelism: gate/up column-parallel, down row-parallel, as PaddleNLP's MixtralMLP);
the router and the shared expert's gate are replicated. Under sequence parallelism the block first
gathers the tensor-parallel ranks' chunks (the router needs whole tokens, and the experts' blocks
have uneven lengths, which fleet's sequence-parallel linears cannot take): inside it every rank
holds every token of the micro-batch, as under tensor parallelism without SP, and afterwards keeps
its own chunk of the (already summed) output.

Dispatch: the (token, slot) pairs are sorted by expert (stable: token order within an expert),
so each expert's tokens are one contiguous block. With a capacity factor each expert keeps its
first ceil(factor x tokens x k / E) pairs and the others are dropped (contribute 0; the default,
factor 0, is dropless like the reference implementations). The dropless blocks' lengths are the
data's: read from the device once per layer; with a capacity factor every block has capacity rows
and the dispatch stays on the device (no host read; `_fixed_capacity_experts`). Under expert parallelism
(expert_parallel_degree ep) each rank holds the E/ep experts [rank x E/ep, (rank+1) x E/ep):
the blocks go to their expert's rank by an all-to-all over fleet's expert group and come back by
a second one (and the reverse pair in backward).

The router statistics of every layer (`RouterStats`) make the auxiliary losses, added to the
language-model loss by the model (`router_losses`):
    load balancing (Switch Transformer eq. 4-6 in Hugging Face's / PaddleNLP's Mixtral form, over
    the layers concatenated):  E x sum_e f_e x P_e, f_e = share of the top-k picks that chose e,
    P_e = mean router probability of e, both over all layers and tokens; x router_aux_loss_coef
    z-loss (ST-MoE, optional): mean over tokens and layers of logsumexp(router logits)^2; x router_z_loss_coef
Both are functions of sums over every token of the micro-batch. Under segment or context
parallelism (sep/cp) each rank routes part of every sequence, so each layer's sums are added over
the sep group (`whole_sequence_stats`): every rank then computes the single-process losses and
metrics, and the gradient of each rank's own probabilities follows from them unchanged (the
parameter gradients are summed over the group by fleet's optimizer, as the language-model loss's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from models import parallel_layers as pl
from models.config import ModelConfig


@dataclass
class RouterStats:
    """One MoE layer's routing of one forward."""

    picks: paddle.Tensor       # [E] float32: how many (token, slot) pairs chose each expert (before dropping)
    prob_sum: paddle.Tensor    # [E] float32: router probabilities summed over tokens (carries gradient)
    z_sum: paddle.Tensor       # []  float32: sum over tokens of logsumexp(logits)^2 (carries gradient)
    dropped: paddle.Tensor     # []  int64: pairs over capacity
    tokens: int
    pick_tokens: int = 0       # tokens the picks were counted over (0: `tokens`; more under global-batch balancing)
    seq_balance: paddle.Tensor | None = None  # [] DeepSeek-V3's sequence-wise balance loss (models/deepseek_moe.py)


def global_batch_stats(config: ModelConfig, stats: RouterStats) -> RouterStats:
    """Global-batch balancing (moe_global_batch_balance; Qwen3, Qiu et al. 2025): the picks of every rank that
    holds other samples of the step's batch (the data-parallel and sharding ranks) summed before the loss, so
    that f_e is the global batch's and P_e stays this rank's. The picks carry no gradient: the loss's gradient
    reaches this rank's router probabilities only, and averaged over the ranks (fleet's data-parallel mean) it
    is the gradient of one process's loss over the whole batch (tests/test_qwen3.py). Identity in one process."""
    if not config.moe_global_batch_balance:
        return stats
    picks, ranks = pl.sum_over_data_replicas(stats.picks)
    return RouterStats(picks=picks, prob_sum=stats.prob_sum, z_sum=stats.z_sum, dropped=stats.dropped,
                       tokens=stats.tokens, pick_tokens=stats.tokens * ranks, seq_balance=stats.seq_balance)


def whole_sequence_stats(config: ModelConfig, stats: RouterStats) -> RouterStats:
    """One layer's statistics over the whole sequences: this rank's summed with those of the other ranks
    of its sep group (identity without sep or cp), in one all-reduce. The probability and z sums keep
    their gradient (pl.sum_over_segments: backward unchanged, since every rank computes the same loss)."""
    if not pl.splits_sequence(config):
        return stats
    experts = config.num_experts
    packed = paddle.concat([stats.picks, stats.prob_sum, stats.z_sum.reshape([1]),
                            stats.dropped.astype("float32").reshape([1])])  # counts: exact in float32
    total = pl.sum_over_segments(config, packed)
    degree = config.sep_parallel_degree * config.context_parallel_degree
    return RouterStats(picks=total[:experts].detach(), prob_sum=total[experts:2 * experts],
                       z_sum=total[2 * experts], dropped=total[2 * experts + 1].detach().astype("int64"),
                       tokens=stats.tokens * degree, seq_balance=stats.seq_balance)  # (summed when made)


def router_losses(config: ModelConfig, stats: list[RouterStats]):
    """(load-balancing loss, z-loss), unscaled, over the layers' statistics (see the module docstring)."""
    tokens = sum(s.tokens for s in stats)
    pick_tokens = sum(s.pick_tokens or s.tokens for s in stats)  # the global batch's under global-batch balancing
    picks = paddle.add_n([s.picks for s in stats])
    prob_sum = paddle.add_n([s.prob_sum for s in stats])
    balance = config.num_experts * (picks * prob_sum).sum() / (pick_tokens * tokens)
    z_loss = paddle.add_n([s.z_sum for s in stats]) / tokens
    return balance, z_loss


class RouterMetrics:
    """What train_log.jsonl reports at a logging step, gathered over the training forwards since the last
    report without a host sync: the load-balancing loss (mean per forward), the ratio of the most to the
    least picked expert (the worst layer; null when an expert got no token), per router the most picked
    expert's picks over the mean, and the pairs dropped."""

    def __init__(self, config: ModelConfig):
        self.config = config
        self.reset()

    def reset(self):
        self.picks, self.dropped, self.balance, self.forwards = None, None, None, 0
        self.mtp_loss, self.mtp_forwards = None, 0

    def add_mtp(self, loss):
        """DeepSeek-V3: the multi-token prediction loss of a training forward (reported as mtp_loss)."""
        loss = loss.detach().astype("float32")
        self.mtp_loss = loss if self.mtp_forwards == 0 else self.mtp_loss + loss
        self.mtp_forwards += 1

    def add(self, stats: list[RouterStats], balance):
        picks = paddle.stack([s.picks for s in stats])  # [layers, E]
        dropped = paddle.add_n([s.dropped for s in stats])
        balance = balance.detach().astype("float32")
        if self.forwards == 0:
            self.picks, self.dropped, self.balance = picks, dropped, balance
        else:
            self.picks, self.dropped, self.balance = self.picks + picks, self.dropped + dropped, self.balance + balance
        self.forwards += 1

    def summary(self) -> dict:
        if not self.forwards:
            return {}
        picks = self.picks.numpy()
        least = picks.min(axis=1)
        ratio = None if (least == 0).any() else float((picks.max(axis=1) / least).max())
        # per router, most picked expert / mean picks: 1 when balanced, E / k when every token goes to the same
        # k experts (1 + MaxVio of Wang et al. 2024, arXiv:2408.15664, the paper of DeepSeek-V3's bias rule)
        max_mean = (picks.max(axis=1) * picks.shape[1] / np.maximum(picks.sum(axis=1), 1)).round(4).tolist()
        out = {"moe_aux_loss": float(self.balance) / self.forwards, "expert_load_max_min_ratio": ratio,
               "expert_load_max_mean": max_mean, "tokens_dropped": int(self.dropped)}
        if self.mtp_forwards:
            out["mtp_loss"] = float(self.mtp_loss) / self.mtp_forwards
        self.reset()
        return out


def expert_parallel_rank_and_degree(config: ModelConfig) -> tuple[int, int]:
    if config.expert_parallel_degree <= 1:
        return 0, 1
    group = expert_parallel_groups(config.expert_parallel_degree)[0]
    return group.rank, group.nranks


_GROUPS: dict = {}


def fleet_expert_groups(hcg) -> bool:
    """Whether fleet built its own expert and moe_sharding groups (EPHybridCommunicateGroup; the plain
    HybridCommunicateGroup answers 0 moe_sharding ranks, fleet/base/topology.py:732)."""
    return hcg.get_moe_sharding_parallel_world_size() > 0


def expert_parallel_groups(ep: int):
    """(expert group, expert-data-parallel group or None, index of this rank in the latter).

    Ranks at the same position of different expert groups hold the same experts: the expert-data-parallel
    group, over which the experts' gradients are reduced (llm_pretrain/parallel/distributed.py and expert_optimizer.py).

    Over sharding ranks (data_parallel_degree 1) these are fleet's own groups: EPHybridCommunicateGroup
    (fleet/base/topology.py:769) cuts the sharding ranks into expert groups of ep consecutive ranks and
    the ranks holding the same experts form its moe_sharding group. Fleet asserts dp_degree 1 there
    (topology.py:880), so over data-parallel ranks the groups are made here alike: the data-parallel ranks
    [d0, d1, ...] cut into expert groups of ep consecutive ranks (rank d holds the experts of expert rank
    d % ep); with ep equal to the data-parallel degree the expert group is fleet's data-parallel group."""
    if ep in _GROUPS:
        return _GROUPS[ep]
    import paddle.distributed as dist
    from paddle.distributed import fleet

    hcg = fleet.get_hybrid_communicate_group()
    if fleet_expert_groups(hcg):
        assert hcg.get_expert_parallel_world_size() == ep, "fleet's expert group is not expert_parallel_degree"
        replicas = hcg.get_moe_sharding_parallel_group() if hcg.get_moe_sharding_parallel_world_size() > 1 else None
        _GROUPS[ep] = (hcg.get_expert_parallel_group(), replicas, hcg.get_moe_sharding_parallel_rank())
        return _GROUPS[ep]
    dp_group = hcg.get_data_parallel_group()
    if ep == dp_group.nranks:
        _GROUPS[ep] = (dp_group, None, 0)
        return _GROUPS[ep]
    me = dist.get_rank()
    found = [None, None, 0]
    # every rank creates every group, in the same order (new_group is collective)
    for ranks in hcg.topology().get_comm_list("data"):
        for start in range(0, len(ranks), ep):
            group = dist.new_group(ranks[start:start + ep])
            if me in ranks[start:start + ep]:
                found[0], found[2] = group, ranks.index(me) // ep
        for position in range(ep):
            group = dist.new_group(ranks[position::ep])
            if me in ranks[position::ep]:
                found[1] = group
    _GROUPS[ep] = tuple(found)
    return _GROUPS[ep]


class AllToAll(paddle.autograd.PyLayer):
    """Rows [sum(send), ...] -> [sum(recv), ...]: send[r] rows to rank r, recv[s] rows from rank s
    (paddle.distributed.alltoall_single with uneven splits); backward sends the gradients back, times
    grad_scale (dispatch_and_combine: 1/data replicas into the experts, data replicas out of them)."""

    @staticmethod
    def forward(ctx, x, send, recv, group, counter, grad_scale=1.0):
        ctx.send, ctx.recv, ctx.group, ctx.counter, ctx.grad_scale = send, recv, group, counter, grad_scale
        if counter is not None:  # the dispatch: rows this rank sends out (its token-expert pairs)
            counter["forward"] += sum(send)
        return _all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.counter is not None:  # the dispatch's backward: the gradients of those pairs coming back
            ctx.counter["backward"] += sum(ctx.send)
        back = _all_to_all(grad, ctx.recv, ctx.send, ctx.group)
        return back if ctx.grad_scale == 1.0 else back * ctx.grad_scale


def _all_to_all(x, send, recv, group):
    import paddle.distributed as dist

    out = paddle.empty([sum(recv)] + list(x.shape[1:]), dtype=x.dtype)
    dist.alltoall_single(out, x, in_split_sizes=send, out_split_sizes=recv, group=group)
    return out


def dispatch_and_combine(moe: "MoE", rows, counts: np.ndarray):
    """Expert parallelism: rows (sorted by global expert, counts[e] each) to the ranks holding their
    experts, through them, and back in the same order."""
    import paddle.distributed as dist

    group, ep, rank, local = moe.ep_group, moe.ep_degree, moe.ep_rank, moe.num_local_experts
    gathered = []
    dist.all_gather(gathered, paddle.to_tensor(counts, dtype="int64"), group=group)
    table = np.stack([t.numpy() for t in gathered]).reshape([ep, ep, local])  # [source, destination rank, expert]
    send = [int(n) for n in table[rank].sum(axis=1)]
    recv = [int(n) for n in table[:, rank].sum(axis=1)]
    # The experts' parameter gradients / data replicas (MoE.__init__): the combine's backward hands the experts
    # their output gradient x scale, the dispatch's backward hands the tokens' owners their input gradient
    # / scale, so only the experts' parameters see the scale (exact for a power-of-two number of replicas).
    scale = moe.expert_grad_scale
    received = AllToAll.apply(rows, send, recv, group, moe.rows_sent, 1.0 / scale)  # by source, then local expert
    # Regroup by local expert: the block of source s for expert j starts at s's offset + its earlier experts.
    starts = np.concatenate([[0], np.cumsum(recv)[:-1]])
    mine = table[:, rank]  # [source, local expert]
    within = np.concatenate([np.zeros([ep, 1], dtype="int64"), np.cumsum(mine, axis=1)[:, :-1]], axis=1)
    order = np.concatenate([np.arange(starts[s] + within[s, j], starts[s] + within[s, j] + mine[s, j])
                            for j in range(local) for s in range(ep)]).astype("int64")
    out, idle_zero = moe._local_experts(paddle.gather(received, paddle.to_tensor(order)),
                                        [int(n) for n in mine.sum(axis=0)])
    back = paddle.gather(out, paddle.to_tensor(np.argsort(order, kind="stable").astype("int64")))
    return AllToAll.apply(back, recv, send, group, None, scale), idle_zero


class MoE(nn.Layer):
    """Router, this rank's experts, and the shared expert with its gate (Qwen2-MoE)."""

    def __init__(self, config: ModelConfig, mlp_class):
        super().__init__()
        self.config = config
        experts, hidden = config.num_experts, config.hidden_size
        self.ep_rank, self.ep_degree = expert_parallel_rank_and_degree(config)
        self.num_local_experts = experts // self.ep_degree
        self.first_expert = self.ep_rank * self.num_local_experts
        self.gate = pl.replicated_linear(hidden, experts, bias=False)
        # The experts and the shared expert take the gathered tokens (see forward): plain tensor parallelism.
        expert_config = config.replace(intermediate_size=config.expert_intermediate_size, fuse_attention_ffn=False,
                                       sequence_parallel=False)
        # Keyed by the global expert index: the parameter names are the single-process model's
        # (layers.{i}.mlp.experts.{e}.gate_proj.weight) on every rank.
        self.experts = nn.LayerDict({str(self.first_expert + j): mlp_class(expert_config)
                                     for j in range(self.num_local_experts)})
        self.ep_group, expert_dp_group, replica = (expert_parallel_groups(self.ep_degree) if self.ep_degree > 1
                                                   else (None, None, 0))
        data_replicas = self.ep_degree * (expert_dp_group.nranks if expert_dp_group else 1)
        for param in self.experts.parameters():
            param.is_expert = True
            if self.ep_degree > 1:
                # Held by one rank of the expert group, not replicated over it: fleet's DataParallel neither
                # broadcasts nor all-reduces it (paddle/distributed/parallel.py:194,484). It gets the gradient
                # of every token of its expert group (the all-to-all's backward), summed; summed again over
                # the expert-data-parallel group (llm_pretrain/parallel/distributed.py; over sharding ranks, to the
                # rank keeping its optimizer states, llm_pretrain/parallel/expert_optimizer.py) it holds every rank's,
                # and the replicated weights' gradients are averaged over the data replicas: hence / their number.
                param.no_sync = True
                # Paddle's mark: broadcast over the moe_sharding group (paddle/distributed/parallel.py:196-201)
                param.expert = True
                param.expert_parallel = True
                param.expert_group, param.expert_dp_group = self.ep_group, expert_dp_group
                param.expert_replica = replica  # 0: the copy a checkpoint stores
        # The experts' gradients / data_replicas (see above), applied at the all-to-alls' backward
        # (dispatch_and_combine) rather than by a hook on each expert parameter: with a tensor hook on a
        # parameter Paddle also accumulates the unhooked gradient into param.grad, which fleet's float32
        # master-gradient hook (amp_master_grad: fleet/utils/mix_precision_utils.py:47-69) asserts is empty,
        # so the second micro-batch's backward failed and the experts' optimizer read a gradient data_replicas
        # times too large.
        self.expert_grad_scale = 1.0 / data_replicas
        if config.shared_expert_intermediate_size:
            self.shared_expert = mlp_class(config.replace(intermediate_size=config.shared_expert_intermediate_size,
                                                          fuse_attention_ffn=False, sequence_parallel=False))
            if config.shared_expert_gate:  # Qwen2-MoE's; DeepSeek-V3's shared expert has none
                self.shared_expert_gate = pl.replicated_linear(hidden, 1, bias=False)
        self.last_stats: RouterStats | None = None
        # rows this rank's dispatching all-to-alls sent in forward and got back in backward (tests count them)
        self.rows_sent = {"forward": 0, "backward": 0}

    def route(self, x):
        """(top-k expert ids [N, k], their weights [N, k], stats) for tokens x [N, hidden]."""
        c = self.config
        logits = self.gate(x).astype("float32")
        probs = F.softmax(logits, axis=-1)
        selected = paddle.argsort(probs, axis=-1, descending=True, stable=True)[:, :c.num_experts_per_tok]
        weights = paddle.take_along_axis(probs, selected, axis=-1)
        if c.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdim=True)
        picks = F.one_hot(selected.flatten(), c.num_experts).sum(axis=0)
        z_sum = (paddle.logsumexp(logits, axis=-1) ** 2).sum() if c.router_z_loss_coef else paddle.zeros([])
        stats = RouterStats(picks=picks.detach(), prob_sum=probs.sum(axis=0), z_sum=z_sum,
                            dropped=paddle.zeros([], dtype="int64"), tokens=x.shape[0])
        return selected, weights.astype(x.dtype), stats

    def forward(self, hidden):
        # Sequence parallelism: every token of the micro-batch (fleet's GatherOp; its backward keeps this
        # rank's chunk of the gradient, which is whole and the same on every rank, as the output's below).
        hidden = pl.gather_sequence(self.config, hidden)
        shape = hidden.shape
        x = hidden.reshape([-1, shape[-1]])
        selected, weights, stats = self.route(x)
        k = self.config.num_experts_per_tok
        flat = selected.flatten()  # pair p = token p // k, slot p % k
        kept = self._capacity_keep(selected.reshape([shape[0], -1, k]))
        if kept is not None:
            stats.dropped = (~kept[0]).astype("int64").sum()
        if kept is not None and self.ep_degree == 1:
            pair_out, idle_zero = self._fixed_capacity_experts(x, flat, *kept), None
        else:
            pair_out, idle_zero = self._counted_experts(x, flat, kept[0] if kept is not None else None)
        out = (pair_out.reshape([-1, k, shape[-1]]) * weights.unsqueeze(-1)).sum(axis=1)
        if self.config.shared_expert_intermediate_size:
            shared = self.shared_expert(x)
            out = out + (F.sigmoid(self.shared_expert_gate(x)) * shared if self.config.shared_expert_gate else shared)
        if idle_zero is not None:
            out = out + idle_zero.astype(out.dtype)
        self.last_stats = global_batch_stats(self.config, whole_sequence_stats(self.config, stats))
        # Sequence parallelism: this rank's chunk of the output, summed over the tensor-parallel ranks by the
        # experts' row-parallel layers (fleet's ScatterOp; backward gathers the chunks' gradients).
        # The compute dtype of the residual stream: under O2 the combine's ops on the O2 black lists (scatter,
        # paddle/amp/amp_lists.py EXTRA_BLACK_LIST; reduce_sum, PaddleNLP's custom list) return float32, which
        # would turn the residual stream float32 from the first MoE layer on. PaddleNLP's MoE casts alike
        # (PaddleNLP 2.8.1 paddlenlp/transformers/mixtral/modeling.py:544, index_add_ of .astype(hidden_states.dtype)).
        return pl.split_sequence(self.config, out.reshape(shape).astype(hidden.dtype))

    def _counted_experts(self, x, flat, keep):
        """Dropless (or under expert parallelism): the pairs sorted by expert, each expert on exactly its own
        rows. The blocks' lengths are data: one host read per layer (the routed experts and kept pairs
        together), as every dropless reference reads them (PaddleNLP 2.8.1's Mixtral: paddle.where and a
        shape test per expert, mixtral/modeling.py:531-535; Megatron-LM's and PaddleFormers' token dispatchers
        once per layer for their grouped GEMM and all-to-all split sizes). -> (pair outputs, idle zero)"""
        k = self.config.num_experts_per_tok
        ids = (flat if keep is None else paddle.stack([flat, keep.astype("int64")])).numpy()
        flat_ids, keep = (ids, None) if keep is None else (ids[0], ids[1].astype(bool))
        order = np.argsort(flat_ids, kind="stable")  # pairs grouped by expert, tokens in order within one
        if keep is not None:
            order, flat_ids = order[keep[order]], flat_ids[keep]
        counts = np.bincount(flat_ids, minlength=self.config.num_experts)
        order = paddle.to_tensor(order.astype("int64"))
        expert_out, idle_zero = self.run_experts(paddle.gather(x, order // k), counts)
        return paddle.scatter(paddle.zeros([flat.shape[0], x.shape[-1]], dtype=x.dtype), order,
                              expert_out), idle_zero

    def _fixed_capacity_experts(self, x, flat, keep, capacity):
        """With a capacity factor every expert's block has a length known without the data (capacity rows):
        the dispatch is gathers and a scatter on the device and no host read, as GShard's fixed-capacity
        dispatch (Lepikhin et al. 2020, its dispatch/combine tensors), which PaddleNLP 3.0's moe_layer.py
        follows. A kept pair goes to the row of its expert's block given by its place among this rank's kept
        pairs of that expert; rows no pair fills are zeros whose outputs nobody takes (so an idle expert gets
        a zero gradient, as `_local_experts` gives it). A block has min(capacity, this rank's tokens) rows: an
        expert keeps at most capacity pairs and gets at most one pair per token. -> pair outputs
        [pairs, hidden] (0 for dropped pairs), the same values as `_counted_experts`."""
        c = self.config
        k, experts, pairs, hidden = c.num_experts_per_tok, c.num_experts, flat.shape[0], x.shape[-1]
        block = min(capacity, pairs // k)
        kept = F.one_hot(flat, experts).astype("int64") * keep.astype("int64").unsqueeze(-1)  # [pairs, E]
        place = (paddle.cumsum(kept, axis=0) * kept).sum(axis=1) - 1  # a running count of each expert's kept pairs
        spare = experts * block  # every dropped pair's slot: a zero output row
        slot = paddle.where(keep, flat * block + place, paddle.full_like(flat, spare))
        filler = paddle.scatter(paddle.full([spare + 1], pairs, dtype="int64"), slot,
                                paddle.arange(pairs, dtype="int64"))[:spare]  # the pair filling each row (pairs: none)
        rows = paddle.gather(paddle.concat([x, paddle.zeros([1, hidden], dtype=x.dtype)]), filler // k)
        outputs = [self.experts[str(e)](rows[e * block:(e + 1) * block]) for e in range(experts)]
        outputs.append(paddle.zeros([1, hidden], dtype=outputs[0].dtype))
        return paddle.gather(paddle.concat(outputs), slot)

    def _capacity_keep(self, expert_ids):
        """With a capacity factor (None: dropless): which of this rank's pairs (expert_ids [batch, tokens, k]
        -> [pairs] bool) it keeps, and the capacity. Each expert keeps its first ceil(factor x pairs / E)
        pairs of the micro-batch, in the order of its tokens. Under sep/cp the ranks' parts of the sequences
        are gathered first, so that every rank drops what one process drops. On the device: no host read
        (the place is a running count of each expert's pairs)."""
        factor = self.config.moe_capacity_factor
        if not factor:
            return None
        whole, mine = pl.whole_sequences(self.config, expert_ids)
        flat = whole.reshape([-1])
        capacity = math.ceil(factor * flat.shape[0] / self.config.num_experts)
        picked = F.one_hot(flat, self.config.num_experts).astype("int64")  # [pairs, E]
        place = ((paddle.cumsum(picked, axis=0) * picked).sum(axis=1) - 1).reshape(whole.shape)
        if mine is not None:
            place = paddle.index_select(place, mine, axis=1)
        return place.reshape([-1]) < capacity, capacity

    def run_experts(self, expert_in, counts):
        """Each expert on its block of rows (rows sorted by expert; counts[e] rows for expert e) ->
        (their outputs in the same order, a zero that depends on every idle expert's parameters)."""
        if self.ep_degree == 1:
            return self._local_experts(expert_in, [int(n) for n in counts])
        return dispatch_and_combine(self, expert_in, np.asarray(counts, dtype="int64"))

    def _local_experts(self, rows, counts: list[int]):
        """This rank's experts on consecutive blocks of `rows` (counts: one block per local expert)."""
        outputs, idle, start = [], [], 0
        for j, n in enumerate(counts):
            expert = self.experts[str(self.first_expert + j)]
            if n:
                outputs.append(expert(rows[start:start + n]))
            else:
                # An idle expert still gets a gradient (zeros), so every layout updates the same
                # parameters (AdamW decays weights and moments on a zero gradient, not on a missing one).
                idle += [(p * 0).sum() for p in expert.parameters()]
            start += n
        out = paddle.concat(outputs) if outputs else rows * 0
        return out, (paddle.add_n(idle) if idle else None)
