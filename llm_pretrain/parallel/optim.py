"""AdamW and the learning-rate schedule: linear warmup, then cosine or linear decay, or
warmup-stable-decay (wsd: held at the peak, then the last part of the run decays)."""

from __future__ import annotations

import math

import paddle
from paddle.optimizer.lr import LRScheduler

from llm_pretrain.arguments import Arguments

# ERNIE 4.5's "half_life" WSD decay: base**progress, rescaled to run from 1 to 0 (see wsd_decay_coefficient).
HALF_LIFE_BASE = 0.05


def wsd_decay_coefficient(progress: float, style: str) -> float:
    """How much of (max_lr - min_lr) is left at `progress` (0 at the decay's start, 1 at its end).

    linear 1 - p; cosine 0.5 (1 + cos(pi p)); 1-sqrt 1 - sqrt(p) (MiniCPM, ERNIE 4.5); half_life
    (0.05**p - 0.05) / 0.95, PaddleFormers' default decay_function (ERNIE's wsd_lr.py, cited in
    learning_rate_at)."""
    if style == "linear":
        return 1.0 - progress
    if style == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if style == "1-sqrt":
        return 1.0 - math.sqrt(progress)
    if style == "half_life":
        return (HALF_LIFE_BASE ** progress - HALF_LIFE_BASE) / (1.0 - HALF_LIFE_BASE)
    raise ValueError(f"unknown wsd decay style {style!r}")


def learning_rate_at(step: int, max_lr: float, min_lr: float, warmup_steps: float, decay_steps: int,
                     kind: str, decay_start: float | None = None, decay_style: str = "1-sqrt") -> float:
    """Learning rate of optimizer step `step` (1-based).

    Warmup rises linearly to max_lr over warmup_steps (step 1 already trains, at
    max_lr / warmup_steps); the decay then falls to min_lr at decay_steps and
    stays there. This is PaddleNLP's pretraining curve step for step: llm/run_pretrain.py
    builds CosineAnnealingWithWarmupDecay / LinearAnnealingWithWarmupDecay
    (paddlenlp/transformers/optimization.py) with last_epoch=0, and Paddle's LRScheduler
    steps once in its constructor, so the first optimizer step uses last_epoch 1, i.e.
    max_lr / warmup_steps (tests/test_lr_schedule.py compares the two step by step).

    kind "wsd" (warmup-stable-decay): after the warmup the rate stays at max_lr until step
    decay_start, then falls to min_lr at decay_steps with decay_style:
    min_lr + coefficient(progress) x (max_lr - min_lr), progress = (step - decay_start) /
    (decay_steps - decay_start). This is the curve of ERNIE 4.5's get_wsd_schedule_with_warmup
    (PaddlePaddle/ERNIE examples/pre-training/ernie/src/lr_schedulers/wsd_lr.py, imported by
    PaddleFormers' examples/experiments/ernie_pretrain/ernie/src/trainers/pretraining_trainer.py
    create_scheduler) evaluated at the optimizer step's number; that LambdaDecay gives optimizer
    step k its value at k - 1 (its first step trains at rate 0), ours at k, as every schedule here.
    """
    if warmup_steps > 0 and step <= warmup_steps:
        return max_lr * step / warmup_steps
    if kind == "constant":
        return max_lr
    if kind == "wsd" and step < decay_start:
        return max_lr
    if step >= decay_steps:
        return min_lr
    if kind == "wsd":
        progress = (step - decay_start) / (decay_steps - decay_start)
        return min_lr + wsd_decay_coefficient(progress, decay_style) * (max_lr - min_lr)
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    if kind == "cosine":
        coefficient = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:  # linear
        coefficient = 1.0 - progress
    return min_lr + coefficient * (max_lr - min_lr)


class WarmupDecaySchedule(LRScheduler):
    """Paddle scheduler over `learning_rate_at`; last_epoch counts finished optimizer steps.

    Only last_epoch (and last_lr) go into a checkpoint (LRScheduler.state_dict): a resumed run
    recomputes its rate from the step, so it follows the closed form across a resume."""

    def __init__(self, max_lr: float, min_lr: float, warmup_steps: float, decay_steps: int, kind: str,
                 decay_start: float | None = None, decay_style: str = "1-sqrt"):
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_steps, self.decay_steps, self.kind = warmup_steps, decay_steps, kind
        self.decay_start, self.decay_style = decay_start, decay_style
        super().__init__(learning_rate=max_lr, last_epoch=-1)

    def get_lr(self) -> float:
        # Before the optimizer step number last_epoch + 1.
        return learning_rate_at(self.last_epoch + 1, self.max_lr, self.min_lr,
                                self.warmup_steps, self.decay_steps, self.kind,
                                self.decay_start, self.decay_style)

    def phase(self, step: int) -> str:
        """warmup, stable, decay or end (at min_lr) for optimizer step `step` (1-based)."""
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return "warmup"
        if self.kind == "constant" or (self.kind == "wsd" and step < self.decay_start):
            return "stable"
        return "decay" if step < self.decay_steps else "end"

    def describe(self) -> dict:
        """The schedule as built, for the run record."""
        described = {"kind": self.kind, "max_lr": self.max_lr, "min_lr": self.min_lr,
                     "warmup_steps": self.warmup_steps, "decay_end_step": self.decay_steps}
        if self.kind == "wsd":
            described.update(decay_start_step=self.decay_start, decay_style=self.decay_style)
        return described


def build_schedule(args: Arguments) -> WarmupDecaySchedule:
    wsd = args.lr_scheduler_type == "wsd"  # the wsd keys are read only for wsd
    return WarmupDecaySchedule(
        max_lr=args.learning_rate,
        min_lr=args.min_learning_rate,
        warmup_steps=args.effective_warmup_steps,
        decay_steps=args.decay_steps or args.max_steps,
        kind=args.lr_scheduler_type,
        decay_start=args.wsd_decay_start if wsd else None,
        decay_style=args.wsd_decay_style if wsd else "1-sqrt",
    )


def _decays(structured_name: str) -> bool:
    """Weight decay applies to weight matrices, not to norms and biases (as in PaddleNLP)."""
    return not any(word in structured_name for word in ("bias", "norm"))


# Sharding stage 3 replaces each parameter above 2**20 elements, in the optimizer, by its slice
# named "slice@<parameter name>" (group_sharded_stage3.py, _param_storage and _TensorWrapper).
STAGE3_SLICE_PREFIX = "slice@"


def decays_parameter(internal_name: str, decayed: set[str]) -> bool:
    """Whether AdamW decays the parameter (or stage-3 slice of one) of this internal name."""
    return internal_name.removeprefix(STAGE3_SLICE_PREFIX) in decayed


def build_optimizer(args: Arguments, model, schedule: LRScheduler) -> paddle.optimizer.AdamW:
    named = model.canonical_named_parameters()
    decayed = {param.name for name, param in named if _decays(name)}
    clip = paddle.nn.ClipGradByGlobalNorm(args.max_grad_norm) if args.max_grad_norm > 0 else None
    return paddle.optimizer.AdamW(
        learning_rate=schedule,
        parameters=[param for _, param in named],
        beta1=args.adam_beta1,
        beta2=args.adam_beta2,
        epsilon=args.adam_epsilon,
        weight_decay=args.weight_decay,
        apply_decay_param_fun=lambda internal_name: decays_parameter(internal_name, decayed),
        grad_clip=clip,
    )
