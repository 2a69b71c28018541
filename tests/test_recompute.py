"""Recompute really recomputes: the chosen part of a decoder layer runs again in the backward pass.

(The parity tests show that recompute leaves losses and weights unchanged; this shows it is on.)
"""

import dataclasses

import numpy as np
import paddle
import pytest

from models.decoder import Attention, CausalLM, DecoderLayer
from models.registry import make_config
from models.weights import init_weights

PARTS = {"full": (DecoderLayer, "forward"), "full_attn": (DecoderLayer, "attention_block"),
         "core_attn": (Attention, "core_attention")}


def count_calls_of_the_part(granularity: str, monkeypatch) -> list[int]:
    """The layer index of every call of the part `granularity` recomputes, from now on (a list that grows)."""
    owner, method = PARTS[granularity]
    calls = []
    original = getattr(owner, method)

    def counted(self, *args, **kwargs):
        calls.append(self.layer_index)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(owner, method, counted)
    return calls


@pytest.mark.parametrize("granularity", sorted(PARTS))
def test_recomputed_part_runs_twice_except_in_no_recompute_layers(granularity, monkeypatch):
    config = make_config("llama", vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=64)
    config = dataclasses.replace(config, seq_length=16, recompute=True, recompute_granularity=granularity,
                                 no_recompute_layers=[1])
    paddle.seed(0)
    model = CausalLM(config)
    init_weights(model, config, seed=0)
    calls = count_calls_of_the_part(granularity, monkeypatch)
    tokens = paddle.randint(0, 64, [2, 16])
    loss = model(tokens, tokens)
    forward_calls = sorted(calls)
    loss.backward()
    assert forward_calls == [0, 1, 2]
    assert sorted(calls) == [0, 0, 1, 2, 2]  # layers 0 and 2 again in backward; layer 1 is excluded


# Issue 34's families (tiny presets, 2 layers: ERNIE 4.5 MoE's layer 0 dense, layer 1 MoE with shared experts and
# the correction bias; Qwen3-MoE's both sparse): every granularity gives one process's loss, gradients (the
# routers' through the load-balancing loss among them) and, with the bias rule on, the moved correction bias, while
# the recomputed part of each layer ran again in backward. (Their multi-process runs: tests/test_parallel_parity.py
# sd2 layout_granularity and qwen3-short / ernie4_5_moe-short under pp2 with full recompute.)
ISSUE34_TINY = ("qwen3-tiny", "qwen3-moe-tiny", "ernie4_5-tiny", "ernie4_5_moe-tiny")


def _train_step(config, tokens):
    """One forward and backward of the tiny preset (seeded weights): loss, gradients, routers' biases moved."""
    model = CausalLM(config)
    init_weights(model, config, seed=0)
    model.train()
    loss = model(tokens, tokens)
    loss.backward()
    model.update_router_biases()  # (ERNIE 4.5 MoE: by the step's load; the others: no bias)
    grads = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
    biases = {n: p.numpy() for n, p in model.named_parameters() if n.endswith("e_score_correction_bias")}
    return float(loss), grads, biases


@pytest.mark.parametrize("granularity", sorted(PARTS))
@pytest.mark.parametrize("preset", ISSUE34_TINY)
def test_issue34_families_recompute_changes_nothing_but_runs_again(preset, granularity, monkeypatch):
    from models.registry import ARCHITECTURES

    config = ARCHITECTURES[preset].replace(seq_length=16)
    if config.has_correction_bias:  # ERNIE 4.5 MoE with its bias rule on
        config = config.replace(moe_bias_update_rate=0.01)
    tokens = paddle.to_tensor(np.random.default_rng(0).integers(0, config.vocab_size, (2, 16)), dtype="int64")
    loss, grads, biases = _train_step(config, tokens)
    calls = count_calls_of_the_part(granularity, monkeypatch)
    got_loss, got_grads, got_biases = _train_step(config.replace(recompute=True, recompute_granularity=granularity),
                                                  tokens)
    assert sorted(calls) == [0, 0, 1, 1], calls  # each layer's part once in forward, once more in backward
    assert abs(got_loss - loss) <= 1e-6, (got_loss, loss)
    assert got_grads.keys() == grads.keys(), got_grads.keys() ^ grads.keys()
    for name, grad in grads.items():
        np.testing.assert_allclose(got_grads[name], grad, rtol=0, atol=1e-6, err_msg=name)
    assert bool(biases) == config.has_correction_bias and got_biases.keys() == biases.keys(), biases
    assert all(np.abs(b).max() > 0 for b in biases.values()), biases  # the rule moved them
    for name, bias in biases.items():  # (the bias rule's sign of mean - load: the load counted again is the same sign)
        np.testing.assert_array_equal(got_biases[name], bias, err_msg=name)
