"""Work a training step does once, not once per decoder layer (issue 33, findings 4 and 5).

- Host reads: a training step (forward, backward, AdamW step) reads the device from the host as often
  with 4 layers as with 2 (counted on Paddle's tensor-to-host entry points). Dense families and MoE with a
  capacity factor read nothing; a dropless MoE layer reads its routed experts once (the blocks' lengths are
  data; models/moe.py _counted_experts), and no more. The ring's ALiBi slopes come without a device read.
- Masks: the causal / ALiBi additive mask (plain path) and the flash kernel's ALiBi mask are built once
  and shared by every layer and forward (models/constants.py); logits and gradients equal those of a mask
  built in every layer. The ring's positions, slopes and diagonal causal mask likewise.
"""

from __future__ import annotations

import contextlib

import numpy as np
import paddle
import pytest

from models import constants, decoder
from models.decoder import CausalLM
from models.registry import resolve_model

HOST_READS = ("numpy", "item", "tolist", "__int__", "__float__", "__bool__", "__index__", "__array__")


@contextlib.contextmanager
def counted_host_reads():
    """Count the outermost calls of Paddle's tensor-to-host entry points (item() may call numpy() inside)."""
    count, depth, originals = [0], [0], {name: getattr(paddle.Tensor, name) for name in HOST_READS}

    def counting(original):
        def read(self, *args, **kwargs):
            count[0] += depth[0] == 0
            depth[0] += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                depth[0] -= 1
        return read

    for name, original in originals.items():
        setattr(paddle.Tensor, name, counting(original))
    try:
        yield count
    finally:
        for name, original in originals.items():
            setattr(paddle.Tensor, name, original)


def reads_per_step(config) -> int:
    paddle.seed(0)
    model = CausalLM(config)
    optimizer = paddle.optimizer.AdamW(1e-3, parameters=model.parameters(),
                                       grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    ids = paddle.to_tensor(np.random.RandomState(0).randint(0, config.vocab_size, [2, 16]))

    def step():
        model(ids, labels=ids).backward()
        optimizer.step()
        optimizer.clear_grad()

    step()  # the first step builds the shared constants
    with counted_host_reads() as count:
        step()
    return count[0]


CASES = {
    "llama-tiny": {}, "bloom-tiny": {}, "baichuan-tiny": {}, "gpt3-tiny": {},
    "mixtral-capped": ("mixtral-tiny", {"moe_capacity_factor": 1.0}),
    "qwen2-moe-capped": ("qwen2-moe-tiny", {"moe_capacity_factor": 0.5, "router_z_loss_coef": 0.001}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_training_step_reads_the_host_no_more_with_more_layers(case):
    name, changes = CASES[case] if isinstance(CASES[case], tuple) else (case, CASES[case])
    config = resolve_model(name)[0].replace(**changes)
    counts = [reads_per_step(config.replace(num_hidden_layers=layers)) for layers in (2, 4)]
    assert counts == [0, 0], (case, counts)


def test_dropless_moe_reads_its_routing_once_per_layer():
    """Dropless experts run on blocks whose lengths are the data's: one host read per MoE layer, no more
    (a capacity factor removes it: the test above)."""
    config = resolve_model("mixtral-tiny")[0]
    assert [reads_per_step(config.replace(num_hidden_layers=layers)) for layers in (2, 4)] == [2, 4]


def test_the_ring_takes_the_alibi_slopes_without_a_device_read(monkeypatch):
    """Context parallelism hands each layer's slopes to the ring as floats kept at construction."""
    import models.ring_attention as ring

    config = resolve_model("bloom-tiny")[0].replace(num_hidden_layers=2)
    model = CausalLM(config)
    seen = []
    monkeypatch.setattr(ring, "ring_attention", lambda q, k, v, seq, slopes, group, *rest: seen.append(slopes) or q)
    monkeypatch.setattr(decoder.pl, "sequence_group", lambda: None)
    q = paddle.zeros([1, 8, config.num_attention_heads, config.head_dim])
    with counted_host_reads() as count:
        for layer in model.layers:
            layer.self_attn.ring_attention(q, q, q)
    assert count[0] == 0
    assert seen == [pytest.approx(layer.self_attn.alibi_slopes.numpy().tolist()) for layer in model.layers]


# ----------------------------------------------------------------------------- masks
def _logits_and_grads(config, seed=0):
    paddle.seed(seed)
    model = CausalLM(config)
    ids = paddle.to_tensor(np.random.RandomState(seed).randint(0, config.vocab_size, [2, 16]))
    logits = model(ids)
    logits.sum().backward()
    return logits.numpy(), {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}


def _unshared(kind, key, build):
    """A mask built at every call (what each layer did before)."""
    constants.BUILDS[kind] += 1
    with paddle.no_grad(), paddle.amp.auto_cast(False):
        return build()


@pytest.mark.parametrize("name, kinds", [("bloom-tiny", ("causal_mask", "alibi_bias")),
                                         ("baichuan-tiny", ("causal_mask", "alibi_bias")), ("llama-tiny", ("causal_mask",))])
def test_one_attention_mask_per_forward_whatever_the_layers(name, kinds, monkeypatch):
    config = resolve_model(name)[0]
    assert (config.position_embedding == "alibi") == ("alibi_bias" in kinds)
    for layers in (2, 4):
        constants.clear()
        shared = _logits_and_grads(config.replace(num_hidden_layers=layers))
        assert constants.BUILDS == {kind: 1 for kind in kinds}, (layers, constants.BUILDS)
        _logits_and_grads(config.replace(num_hidden_layers=layers))  # a second forward builds nothing
        assert constants.BUILDS == {kind: 1 for kind in kinds}
    # the same logits and gradients as masks built in every layer
    with monkeypatch.context() as patch:
        patch.setattr(decoder, "shared_constant", _unshared)
        constants.clear()
        per_layer = _logits_and_grads(config.replace(num_hidden_layers=4))
        assert constants.BUILDS == {kind: 4 for kind in kinds}
    np.testing.assert_array_equal(shared[0], per_layer[0])
    for param, grad in shared[1].items():
        np.testing.assert_array_equal(grad, per_layer[1][param])


def test_the_flash_alibi_mask_is_one_tensor_for_every_layer():
    """Under use_flash_attention the [batch, heads, seq, seq] mask the kernel keeps for backward: one for all
    layers (on the kernel stand-in, as the GPU path), the same logits as the plain path."""
    from llm_pretrain.cpu import kernel_standins as ks

    ks.install_kernel_standins()
    try:
        config = resolve_model("bloom-tiny")[0].replace(num_hidden_layers=4)
        constants.clear()
        flash = _logits_and_grads(config.replace(use_flash_attention=True))
        assert constants.BUILDS == {"flash_alibi_mask": 1, "alibi_bias": 1, "causal_mask": 1}
    finally:
        ks.uninstall_kernel_standins()
    plain = _logits_and_grads(config)
    np.testing.assert_allclose(flash[0], plain[0], atol=1e-5)


def test_the_ring_builds_its_positions_slopes_and_diagonal_mask_once(monkeypatch):
    """Two layers' rings (cp2, ALiBi, in threads: llm_pretrain/selfcheck/ring_threads.py): each rank's positions, the
    slopes and the diagonal block's causal mask are built once, not per layer, step or backward."""
    from llm_pretrain.selfcheck.ring_threads import ring_in_threads
    from test_ring_blocks import BATCH, HEAD_DIM, HEADS, KV_HEADS, SEQ, SLOPES, _random
    from models.ring_attention import PlainBlocks

    q = _random(BATCH, SEQ, HEADS, HEAD_DIM, seed=1)
    k, v = (_random(BATCH, SEQ, KV_HEADS, HEAD_DIM, seed=seed) for seed in (2, 3))
    grad_out = _random(BATCH, SEQ, HEADS, HEAD_DIM, seed=4)
    constants.clear()
    first = ring_in_threads(2, q, k, v, grad_out, SLOPES, PlainBlocks)
    built = dict(constants.BUILDS)
    second = ring_in_threads(2, q, k, v, grad_out, SLOPES, PlainBlocks)
    assert built["ring_slopes"] == 1 and built["ring_causal_mask"] == 1
    assert built["ring_positions"] == 2  # one per rank; the test's own balanced_positions calls included
    assert constants.BUILDS == built  # the second layer's ring builds nothing
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
