"""Gradient accumulation scales the loss by the number of micro-batches; throughput is per card.

Every case trains a tiny LLaMA (PaddleNLP 2.8.1's LlamaForCausalLM with random weights, the same
weights converted into our CausalLM) with gradient_accumulation_steps 4 x 2 samples x 32 tokens,
and compares our trainer's step (llm_pretrain/run/trainer.py train_step with build_optimizer /
build_schedule, which divides each micro-batch's loss by their number before backward) with:

- fp32, unclipped (max_grad_norm 0) and clipped (max_grad_norm below the gradient norm):
  PaddleNLP 2.8.1's Trainer itself, on its own model with the same weights and the same samples
  in the same order (its BatchSampler without shuffling), 3 optimizer steps at a constant
  learning rate: the per-step loss it logs and the global gradient norm before clipping (read in
  its on_optimizer_begin callback, after accumulation) within 1e-5. The Trainer divides the loss
  by gradient_accumulation_steps in training_step (paddlenlp/trainer/trainer.py:2049-2050).
- fp16 loss scaler, unclipped and clipped: the closed form. PaddleNLP's Trainer cannot run it here:
  Paddle's CPU build has no float16 kernels, and paddle.amp.GradScaler disables itself off the GPU
  (paddle/amp/grad_scaler.py AmpScaler.__init__). What of the scaler path runs on CPU is run: a
  GradScaler enabled on CPU (as tests/test_precision.py does) scales the fp32 loss, the gradients
  are unscaled before the norm and the clipped step. The closed form: the same 8 samples taken
  as ONE batch (one forward, no division, no scaler) give the same loss and the same gradient,
  hence the same norm and (clipped or not) the same weights after each step, within 1e-5.
  The fp32 cases are checked against this closed form too (it costs milliseconds).

A missing division makes the gradient (and its norm) 4 times too large: the norms differ in
every case, and the clipped steps move the weights differently.

Throughput is tokens/card/sec: the GLOBAL tokens of the logged steps divided by the number of
cards (world size) and the wall time (llm_pretrain/observe/metrics.py); checked through MetricsLogger
for a dp2 layout (the all-reductions made local), and against a single card.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from llm_pretrain.arguments import parse_arguments
from llm_pretrain.parallel.layout import Layout
from llm_pretrain.parallel.optim import build_optimizer, build_schedule
from llm_pretrain.parallel.precision import Precision
from llm_pretrain.run.trainer import BatchPlan, train_step
from models.paddlenlp_interop import from_paddlenlp_state
from test_precision import _cpu_grad_scaler
from test_reference_parity import VOCAB, build_ours, build_paddlenlp_model

CASE = "llama_gqa"  # 4 q heads, 2 kv heads, 2 layers, vocabulary 256
MICRO_BATCH, ACCUMULATION, SEQ, STEPS = 2, 4, 32, 3
LEARNING_RATE = 3e-3
CLIP = 0.5  # below every gradient norm of these runs (asserted), so that clipping acts
TOLERANCE = 1e-5


def samples(steps: int = STEPS, seed: int = 3) -> list[np.ndarray]:
    """Token sequences of SEQ + 1 (inputs and shifted labels), in the order both trainers read them."""
    rng = np.random.default_rng(seed)
    return list(rng.integers(0, VOCAB, size=(steps * MICRO_BATCH * ACCUMULATION, SEQ + 1)))


def our_arguments(max_grad_norm: float):
    args, _ = parse_arguments([
        "--model_name_or_path", "llama-tiny", "--input_dir", "unused", "--max_steps", str(STEPS),
        "--per_device_train_batch_size", str(MICRO_BATCH), "--gradient_accumulation_steps", str(ACCUMULATION),
        "--max_seq_length", str(SEQ), "--learning_rate", str(LEARNING_RATE), "--min_learning_rate", "0",
        "--lr_scheduler_type", "constant", "--warmup_steps", "0", "--weight_decay", "0",
        "--adam_epsilon", "1e-5", "--max_grad_norm", str(max_grad_norm)])
    return args


@pytest.fixture(scope="module")
def reference():
    """PaddleNLP's model with random weights, and our config and the same weights in our names."""
    model, raw_config, config = build_paddlenlp_model(CASE, seed=11)
    return model.state_dict(), config, from_paddlenlp_state(config, raw_config, model.state_dict())


def our_model(config, state):
    model = build_ours(config, state)
    model.train()
    return model


def our_run(config, state, max_grad_norm: float, fp16_scaler: bool) -> dict:
    """Our trainer's step over the micro-batches: per-step loss and grad norm, and the final weights."""
    args = our_arguments(max_grad_norm)
    model = our_model(config, state)
    schedule = build_schedule(args)
    optimizer = build_optimizer(args, model, schedule)
    precision = Precision(args, "cpu")
    if fp16_scaler:
        precision.use_scaler(_cpu_grad_scaler(), Layout())
    plan = BatchPlan(MICRO_BATCH, ACCUMULATION, data_replicas=1, data_replica_rank=0)
    parameters = [p for _, p in model.canonical_named_parameters()]
    data = samples()
    losses, norms = [], []
    for step in range(STEPS):
        result = train_step(model, optimizer, schedule, precision,
                            plan.micro_batches(data, step * plan.global_batch_size, VOCAB), parameters)
        assert result.optimizer_stepped and not result.nonfinite
        losses.append(result.loss)
        norms.append(float(result.grad_norm))
    if fp16_scaler:
        scale = float(precision.scaler._scale.numpy().reshape(-1)[0])
        assert scale == 1024.0, f"the loss scale changed ({scale}): an overflow skipped a step"
    return {"loss": losses, "grad_norm": norms, "weights": {n: p.numpy() for n, p in model.canonical_named_parameters()}}


def one_batch_run(config, state, max_grad_norm: float) -> dict:
    """The closed form: each step's micro-batches taken as one batch of 8 (one forward, no division)."""
    args = our_arguments(max_grad_norm)
    model = our_model(config, state)
    schedule = build_schedule(args)
    optimizer = build_optimizer(args, model, schedule)
    data = np.stack(samples())
    losses, norms = [], []
    per_step = MICRO_BATCH * ACCUMULATION
    for step in range(STEPS):
        batch = data[step * per_step:(step + 1) * per_step]
        loss = model(paddle.to_tensor(batch[:, :-1]), paddle.to_tensor(batch[:, 1:]))
        loss.backward()
        norms.append(float(np.sqrt(sum(float((p.grad.astype("float64") ** 2).sum())
                                       for _, p in model.canonical_named_parameters()))))
        losses.append(float(loss))
        optimizer.step()
        optimizer.clear_grad()
        schedule.step()
    return {"loss": losses, "grad_norm": norms, "weights": {n: p.numpy() for n, p in model.canonical_named_parameters()}}


def paddlenlp_trainer_run(paddlenlp_state, max_grad_norm: float, work_dir) -> dict:
    """PaddleNLP 2.8.1's Trainer on its LlamaForCausalLM with the same weights and samples."""
    from paddlenlp.trainer import Trainer, TrainerCallback, TrainingArguments

    model, _, _ = build_paddlenlp_model(CASE, seed=11)
    model.set_state_dict(paddlenlp_state)
    model.train()
    data = samples()

    class Samples(paddle.io.Dataset):
        def __len__(self):
            return len(data)

        def __getitem__(self, i):
            return {"input_ids": data[i][:-1].astype("int64"), "labels": data[i][1:].astype("int64")}

    class InOrder(Trainer):
        def _get_train_sampler(self):  # the Trainer's own sampler, without shuffling
            return paddle.io.BatchSampler(dataset=self.train_dataset, shuffle=False,
                                          batch_size=self.args.per_device_train_batch_size, drop_last=True)

    norms = []

    class GradNorm(TrainerCallback):
        def on_optimizer_begin(self, args, state, control, model=None, **kwargs):  # accumulated, before the clip
            norms.append(float(np.sqrt(sum(float((p.grad.astype("float64") ** 2).sum())
                                           for p in model.parameters() if p.grad is not None))))

    args = TrainingArguments(
        output_dir=str(work_dir), per_device_train_batch_size=MICRO_BATCH, gradient_accumulation_steps=ACCUMULATION,
        learning_rate=LEARNING_RATE, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_epsilon=1e-5, max_grad_norm=max_grad_norm, max_steps=STEPS, logging_steps=1, save_strategy="no",
        seed=11, disable_tqdm=True, report_to=[], dataloader_num_workers=0, no_cuda=True)
    trainer = InOrder(model=model, args=args, train_dataset=Samples(), callbacks=[GradNorm()])
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"loss": losses, "grad_norm": norms}


def assert_same(ours: dict, other: dict, what: str, weights: bool = True) -> None:
    for key in ("loss", "grad_norm"):
        assert len(ours[key]) == len(other[key]) == STEPS, f"{what}: {key} {ours[key]} vs {other[key]}"
        worst = max(abs(a - b) for a, b in zip(ours[key], other[key]))
        assert worst <= TOLERANCE, f"{what}: our {key} {ours[key]} vs {other[key]}"
    if weights:
        worst = max(float(np.abs(ours["weights"][n] - other["weights"][n]).max()) for n in other["weights"])
        assert worst <= TOLERANCE, f"{what}: final weights differ by {worst}"


@pytest.mark.parametrize("max_grad_norm", [0.0, CLIP], ids=["unclipped", "clipped"])
def test_fp32_accumulation_matches_paddlenlp_trainer_and_one_batch(reference, max_grad_norm, tmp_path):
    paddlenlp_state, config, state = reference
    ours = our_run(config, state, max_grad_norm, fp16_scaler=False)
    if max_grad_norm:
        assert min(ours["grad_norm"]) > max_grad_norm, f"clipping never acted: {ours['grad_norm']}"
    assert_same(ours, paddlenlp_trainer_run(paddlenlp_state, max_grad_norm, tmp_path), "PaddleNLP Trainer",
                weights=False)
    assert_same(ours, one_batch_run(config, state, max_grad_norm), "one batch of 8")


@pytest.mark.parametrize("max_grad_norm", [0.0, CLIP], ids=["unclipped", "clipped"])
def test_fp16_scaler_accumulation_matches_one_batch(reference, max_grad_norm):
    _, config, state = reference
    ours = our_run(config, state, max_grad_norm, fp16_scaler=True)
    if max_grad_norm:
        assert min(ours["grad_norm"]) > max_grad_norm, f"clipping never acted: {ours['grad_norm']}"
    assert_same(ours, one_batch_run(config, state, max_grad_norm), "one batch of 8 (fp16 scaler)")


@pytest.mark.parametrize("world_size", [1, 2])
def test_tokens_per_card_are_global_tokens_over_cards(world_size, tmp_path, monkeypatch):
    """tokens/card/sec = global tokens of the step / world size / step time (and TFLOPs per card from it)."""
    from llm_pretrain.observe import metrics
    from llm_pretrain.observe.metrics import MetricsLogger

    # No process group here: the reductions over ranks pass this rank's values through (the rule under
    # test is the division, not the reductions).
    monkeypatch.setattr(metrics, "reduce_for_log", lambda loss, norms, memory, layout: (
        loss, None if None in norms else sum(norms) / len(norms), memory))
    monkeypatch.setattr(metrics, "rank_times", lambda own_time, data_wait, layout: {})
    layout = Layout(world_size=world_size, data_parallel_degree=world_size)
    global_tokens = MICRO_BATCH * ACCUMULATION * world_size * SEQ  # dp2 reads twice the samples per step
    logger = MetricsLogger(str(tmp_path), layout, "cpu", max_steps=2, logging_steps=2, flops_per_token=6e6,
                           global_tokens_per_step=global_tokens, start_step=0, disable_tqdm=True)
    logger.log._writer = None  # no VisualDL files
    logger.step(1, 2.0, 1.0, 1e-3, step_time=0.25, consumed_samples=8 * world_size)
    logger.step(2, 2.0, 1.0, 1e-3, step_time=0.75, consumed_samples=16 * world_size)
    record = logger.records[-1]
    expected = 2 * global_tokens / world_size / (0.25 + 0.75)
    assert record["tokens_per_card_per_sec"] == pytest.approx(expected, rel=1e-12)
    # each card read its own 8 x 32 tokens in each of the 2 steps, in 1 s together: whatever the world size
    assert record["tokens_per_card_per_sec"] == pytest.approx(2 * MICRO_BATCH * ACCUMULATION * SEQ, rel=1e-12)
    assert record["tflops_per_card"] == pytest.approx(6e6 * expected / 1e12, rel=1e-12)
    assert record["global_tokens_per_step"] == global_tokens
    logger.finish()
