"""The learning-rate schedule is PaddleNLP's pretraining schedule, pinned to its closed form.

PaddleNLP's llm/run_pretrain.py builds CosineAnnealingWithWarmupDecay (or the linear one) with
warmup = warmup_steps, else warmup_ratio x max_steps (not rounded), decay_step = decay_steps or
max_steps, last_epoch=0; its Trainer uses the scheduler's value for an optimizer step, then steps
the scheduler. Closed form for optimizer step k (1-based), warmup W, decay end D:

    k <= W:      max_lr * k / W
    W < k <= D:  min_lr + 0.5 * (1 + cos(pi * (k - W) / (D - W))) * (max_lr - min_lr)   (linear: 1 - ratio)
    k > D:       min_lr
"""

from __future__ import annotations

import math

import pytest
from llm_pretrain.arguments import parse_arguments
from llm_pretrain.parallel.optim import build_schedule
from parity_utils import argv, base_arguments, run_single, train_records, write_json

MAX_LR, MIN_LR = 3e-3, 3e-4


def schedule_for(**keys):
    args, _ = parse_arguments(["--model_name_or_path", "llama-tiny", "--input_dir", "unused",
                               "--learning_rate", str(MAX_LR), "--min_learning_rate", str(MIN_LR)]
                              + [item for key, value in keys.items() for item in (f"--{key}", str(value))])
    return build_schedule(args)


def rates_per_step(scheduler, steps: int) -> list[float]:
    """The rate each of the first `steps` optimizer steps uses (read, then step, as both trainers do)."""
    rates = []
    for _ in range(steps):
        rates.append(scheduler())
        scheduler.step()
    return rates


def test_values_at_chosen_steps_are_the_closed_form():
    # W = 4, D = 20: the peak at step 4, halfway down the cosine at step 12, the minimum from step 20 on.
    rates = rates_per_step(schedule_for(warmup_steps=4, max_steps=30, decay_steps=20), 30)
    expected = {1: MAX_LR / 4, 2: MAX_LR / 2, 4: MAX_LR,
                8: MIN_LR + 0.5 * (1 + math.cos(math.pi / 4)) * (MAX_LR - MIN_LR),
                12: (MAX_LR + MIN_LR) / 2, 20: MIN_LR, 21: MIN_LR, 30: MIN_LR}
    assert {k: rates[k - 1] for k in expected} == pytest.approx(expected, rel=1e-12)
    # Linear decay: halfway at step 12 too, a quarter of the way at step 8.
    linear = rates_per_step(schedule_for(warmup_steps=4, max_steps=30, decay_steps=20, lr_scheduler_type="linear"), 30)
    assert linear[7] == pytest.approx(MAX_LR - 0.25 * (MAX_LR - MIN_LR), rel=1e-12)
    assert linear[11] == pytest.approx((MAX_LR + MIN_LR) / 2, rel=1e-12)
    # warmup_ratio: 0.1 x 25 steps = 2.5 warmup steps, not rounded.
    ratio = rates_per_step(schedule_for(warmup_ratio=0.1, max_steps=25), 3)
    assert ratio == pytest.approx([MAX_LR / 2.5, 2 * MAX_LR / 2.5,
                                   MIN_LR + 0.5 * (1 + math.cos(math.pi * 0.5 / 22.5)) * (MAX_LR - MIN_LR)], rel=1e-12)


@pytest.mark.parametrize("keys", [
    dict(warmup_steps=5, max_steps=40, decay_steps=30),
    dict(warmup_ratio=0.1, max_steps=25),
    dict(warmup_steps=0, max_steps=12),
    dict(warmup_steps=3, max_steps=20, lr_scheduler_type="linear"),
])
def test_same_rate_as_paddlenlp_at_every_step(keys):
    from paddlenlp.transformers import CosineAnnealingWithWarmupDecay, LinearAnnealingWithWarmupDecay

    ours = schedule_for(**keys)
    warmup = keys.get("warmup_steps") or keys.get("warmup_ratio", 0) * keys["max_steps"]
    kind = CosineAnnealingWithWarmupDecay if keys.get("lr_scheduler_type", "cosine") == "cosine" \
        else LinearAnnealingWithWarmupDecay
    # As PaddleNLP's llm/run_pretrain.py builds it.
    theirs = kind(max_lr=MAX_LR, min_lr=MIN_LR, warmup_step=warmup,
                  decay_step=keys.get("decay_steps", keys["max_steps"]), last_epoch=0)
    steps = keys["max_steps"] + 5
    assert rates_per_step(ours, steps) == pytest.approx(rates_per_step(theirs, steps), rel=1e-12, abs=0)


def test_logged_rates_follow_the_closed_form_across_a_resume_in_warmup(embedded_corpus, tmp_path):
    """Stopped after step 2 of a 4-step warmup and resumed: every step's rate is still the closed form."""
    args_file = write_json(tmp_path / "lr.json", base_arguments(
        embedded_corpus, tmp_path, num_hidden_layers=2, warmup_steps=4, max_steps=8, decay_steps=8, save_steps=0,
        learning_rate=MAX_LR, min_learning_rate=MIN_LR))
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_single([argv(args_file, straight), argv(args_file, resumed, exit_interval=2), argv(args_file, resumed)],
               tmp_path, "lr")

    def closed_form(k):
        return MAX_LR * k / 4 if k <= 4 else MIN_LR + 0.5 * (1 + math.cos(math.pi * (k - 4) / 4)) * (MAX_LR - MIN_LR)

    for out in (straight, resumed):
        records = train_records(out)
        assert [r["step"] for r in records] == list(range(1, 9))
        assert [r["learning_rate"] for r in records] == pytest.approx([closed_form(k) for k in range(1, 9)],
                                                                      rel=1e-9)
