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
import subprocess
import sys

import pytest
from llm_pretrain.arguments import parse_arguments
from llm_pretrain.errors import UsageError
from llm_pretrain.parallel.optim import build_schedule
from parity_utils import RUN_PRETRAIN, argv, base_arguments, run_record, run_single, train_records, write_json

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


# ---- warmup-stable-decay ---------------------------------------------------------------------------

WSD_COEFFICIENTS = {  # the share of (max_lr - min_lr) left at progress p of the decay
    "linear": lambda p: 1 - p,
    "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
    "1-sqrt": lambda p: 1 - math.sqrt(p),
    "half_life": lambda p: (0.05 ** p - 0.05) / 0.95,
}


@pytest.mark.parametrize("style", sorted(WSD_COEFFICIENTS))
def test_wsd_is_warmup_then_held_then_the_closed_form_decay(style):
    # W = 4, max_steps 40, wsd_decay_ratio 0.25: held at the peak through step 30, decay over steps 30-40.
    rates = rates_per_step(schedule_for(lr_scheduler_type="wsd", warmup_steps=4, max_steps=40,
                                        wsd_decay_ratio=0.25, wsd_decay_style=style), 45)
    coefficient = WSD_COEFFICIENTS[style]
    expected = [MAX_LR * k / 4 if k <= 4 else MAX_LR if k <= 30
                else MIN_LR + coefficient(min(1.0, (k - 30) / 10)) * (MAX_LR - MIN_LR) for k in range(1, 46)]
    assert rates == pytest.approx(expected, rel=1e-12, abs=0)
    assert rates[29] == MAX_LR and rates[39] == pytest.approx(MIN_LR, rel=1e-12)  # the decay's ends
    assert len(set(rates[4:30])) == 1 and rates[30] < MAX_LR  # held, then falls from step 31 on
    # 1-sqrt at a quarter of the decay (step 32.5 does not exist: step 35 is halfway): 1 - sqrt(0.5).
    if style == "1-sqrt":
        assert rates[34] == pytest.approx(MIN_LR + (1 - math.sqrt(0.5)) * (MAX_LR - MIN_LR), rel=1e-12)


def test_wsd_decay_start_is_not_rounded():
    # wsd_decay_ratio 0.1 of 25 steps: the decay starts at step 22.5, as warmup_ratio is not rounded.
    rates = rates_per_step(schedule_for(lr_scheduler_type="wsd", max_steps=25, wsd_decay_ratio=0.1,
                                        wsd_decay_style="linear"), 25)
    assert rates[21] == MAX_LR
    assert rates[22] == pytest.approx(MIN_LR + (1 - 0.5 / 2.5) * (MAX_LR - MIN_LR), rel=1e-12)


def paddleformers_wsd_rate(current_step, learning_rate, num_warmup_steps, num_training_steps, decay_function,
                           min_lr, num_steady_steps=None):
    """ERNIE 4.5's get_wsd_schedule_with_warmup lambda times the learning rate (PaddlePaddle/ERNIE
    examples/pre-training/ernie/src/lr_schedulers/wsd_lr.py, which PaddleFormers' ERNIE pretraining trainer
    imports), transcribed as the reference of PaddleFormers' spelling."""
    if num_steady_steps is None:
        num_steady_steps = 0.9 * num_training_steps
    if current_step < num_warmup_steps:
        return learning_rate * current_step / max(1, num_warmup_steps)
    if current_step < num_steady_steps:
        return learning_rate
    progress = (current_step - num_steady_steps) / max(1, num_training_steps - num_steady_steps)
    ratio = 1 - math.sqrt(progress) if decay_function == "1-sqrt" else (0.05 ** progress - 0.05) / 0.95
    return learning_rate * (ratio * (1 - min_lr / learning_rate) + min_lr / learning_rate)


@pytest.mark.parametrize("spelling, reference", [
    (dict(lr_scheduler="wsd:30", decay_function="1-sqrt", min_lr=2e-4, warmup_steps=5),
     dict(num_warmup_steps=5, decay_function="1-sqrt", min_lr=2e-4, num_steady_steps=30)),
    # Plain "wsd": the decay starts at 0.9 x max_steps; decay_function's default half_life, min_lr's default 0.
    (dict(lr_scheduler="wsd", warmup_steps=3), dict(num_warmup_steps=3, decay_function="half_life", min_lr=0.0)),
])
def test_paddleformers_spelling_is_paddleformers_curve(spelling, reference):
    """ERNIE 4.5's files' lr_scheduler / decay_function / min_lr give PaddleFormers' curve, evaluated at the
    optimizer step's number (PaddleFormers' LambdaDecay evaluates optimizer step k at k - 1)."""
    args, _ = parse_arguments(["--input_dir", "unused", "--learning_rate", str(MAX_LR), "--max_steps", "40"]
                              + [item for key, value in spelling.items() for item in (f"--{key}", str(value))])
    assert args.lr_scheduler_type == "wsd"
    rates = rates_per_step(build_schedule(args), 40)
    expected = [paddleformers_wsd_rate(k, MAX_LR, num_training_steps=40, **reference) for k in range(1, 41)]
    assert rates == pytest.approx(expected, rel=1e-12, abs=1e-18)


@pytest.mark.parametrize("keys, expected", [
    ({"lr_scheduler": "wsd:x"}, 'lr_scheduler: "wsd:x" is not allowed'),
    ({"lr_scheduler": "wsd:0"}, 'lr_scheduler: "wsd:0" is not allowed'),
    ({"lr_scheduler": "exp"}, 'lr_scheduler: "exp" is not allowed'),
    ({"lr_scheduler": "wsd", "lr_scheduler_type": "cosine"}, "lr_scheduler (in "),
    ({"decay_function": "exp", "lr_scheduler": "wsd"}, 'decay_function: "exp" is not allowed'),
    ({"min_lr": 1e-5, "min_learning_rate": 1e-5}, "min_lr (in "),
    ({"lr_scheduler": "wsd:20", "max_steps": 20}, "wsd_decay_start_step: 20 is not allowed"),
    ({"lr_scheduler_type": "wsd", "wsd_decay_ratio": 0}, "wsd_decay_ratio: 0.0 is not allowed"),
    ({"lr_scheduler_type": "wsd", "wsd_decay_ratio": 1.5}, "wsd_decay_ratio: 1.5 is not allowed"),
    ({"lr_scheduler_type": "wsd", "wsd_decay_style": "exp"}, 'wsd_decay_style: "exp" is not allowed'),
    ({"lr_scheduler_type": "wsd", "decay_steps": 10}, "decay_steps: not used by lr_scheduler_type wsd"),
    ({"lr_scheduler_type": "wsd", "warmup_steps": 19, "wsd_decay_ratio": 0.1}, "warmup_steps: the warmup (19 steps)"),
])
def test_bad_schedule_values_name_the_key(tmp_path, keys, expected):
    with pytest.raises(UsageError) as error:
        parse_arguments([str(write_json(tmp_path / "bad.json", {"input_dir": "unused", "max_steps": 20, **keys}))])
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_bad_schedule_value_is_one_line_exit_2_from_the_command(tmp_path):
    args_file = write_json(tmp_path / "bad.json", {"input_dir": "unused", "max_steps": 20, "lr_scheduler": "wsd:x"})
    result = subprocess.run([sys.executable, str(RUN_PRETRAIN), str(args_file)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stdout == "" and result.stderr.startswith('error: lr_scheduler: "wsd:x" is not allowed')
    assert result.stderr.count("\n") == 1


def test_logged_rates_follow_the_closed_form_across_a_resume(embedded_corpus, tmp_path):
    """Cosine stopped after step 2 of a 4-step warmup, and wsd after step 6 of 8 (its 1-sqrt decay runs
    from step 4 to 8), both resumed (one process for the six runs): every step's rate is the closed form,
    every wsd loss is the uninterrupted run's, and the run record names the schedule as built."""
    cosine_file = write_json(tmp_path / "lr.json", base_arguments(
        embedded_corpus, tmp_path, num_hidden_layers=2, warmup_steps=4, max_steps=8, decay_steps=8, save_steps=0,
        learning_rate=MAX_LR, min_learning_rate=MIN_LR))
    wsd_file = write_json(tmp_path / "wsd.json", base_arguments(
        embedded_corpus, tmp_path, num_hidden_layers=2, warmup_steps=2, max_steps=8, save_steps=0,
        lr_scheduler_type="wsd", wsd_decay_ratio=0.5, wsd_decay_style="1-sqrt",
        learning_rate=MAX_LR, min_learning_rate=MIN_LR))
    cosine, cosine_resumed = tmp_path / "cosine", tmp_path / "cosine-resumed"
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_single([argv(cosine_file, cosine), argv(cosine_file, cosine_resumed, exit_interval=2),
                argv(cosine_file, cosine_resumed),
                argv(wsd_file, straight), argv(wsd_file, resumed, exit_interval=6), argv(wsd_file, resumed)],
               tmp_path, "lr")

    def cosine_closed_form(k):
        return MAX_LR * k / 4 if k <= 4 else MIN_LR + 0.5 * (1 + math.cos(math.pi * (k - 4) / 4)) * (MAX_LR - MIN_LR)

    for out in (cosine, cosine_resumed):
        records = train_records(out)
        assert [r["step"] for r in records] == list(range(1, 9))
        assert [r["learning_rate"] for r in records] == pytest.approx([cosine_closed_form(k) for k in range(1, 9)],
                                                                      rel=1e-9)

    def closed_form(k):
        return MAX_LR * k / 2 if k <= 2 else MAX_LR if k <= 4 else \
            MIN_LR + (1 - math.sqrt((k - 4) / 4)) * (MAX_LR - MIN_LR)

    straight_records, resumed_records = train_records(straight), train_records(resumed)
    for records in (straight_records, resumed_records):
        assert [r["step"] for r in records] == list(range(1, 9))
        assert [r["learning_rate"] for r in records] == pytest.approx([closed_form(k) for k in range(1, 9)],
                                                                      rel=1e-9)
    assert [r["loss"] for r in resumed_records] == pytest.approx([r["loss"] for r in straight_records],
                                                                 rel=0, abs=1e-5)
    assert run_record(resumed)["start_step"] == 6
    assert run_record(resumed)["lr_schedule"] == {
        "kind": "wsd", "max_lr": MAX_LR, "min_lr": MIN_LR, "warmup_steps": 2, "decay_end_step": 8,
        "decay_start_step": 4.0, "decay_style": "1-sqrt"}
