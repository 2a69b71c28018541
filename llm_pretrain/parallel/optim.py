"""AdamW and the learning-rate schedule: linear warmup, then cosine (or linear) decay."""

from __future__ import annotations

import math

import paddle
from paddle.optimizer.lr import LRScheduler

from llm_pretrain.arguments import Arguments


def learning_rate_at(step: int, max_lr: float, min_lr: float, warmup_steps: float, decay_steps: int,
                     kind: str) -> float:
    """Learning rate of optimizer step `step` (1-based).

    Warmup rises linearly to max_lr over warmup_steps (step 1 already trains, at
    max_lr / warmup_steps); the decay then falls to min_lr at decay_steps and
    stays there. This is PaddleNLP's pretraining curve step for step: llm/run_pretrain.py
    builds CosineAnnealingWithWarmupDecay / LinearAnnealingWithWarmupDecay
    (paddlenlp/transformers/optimization.py) with last_epoch=0, and Paddle's LRScheduler
    steps once in its constructor, so the first optimizer step uses last_epoch 1, i.e.
    max_lr / warmup_steps (tests/test_lr_schedule.py compares the two step by step).
    """
    if warmup_steps > 0 and step <= warmup_steps:
        return max_lr * step / warmup_steps
    if kind == "constant":
        return max_lr
    if step >= decay_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    if kind == "cosine":
        coefficient = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:  # linear
        coefficient = 1.0 - progress
    return min_lr + coefficient * (max_lr - min_lr)


class WarmupDecaySchedule(LRScheduler):
    """Paddle scheduler over `learning_rate_at`; last_epoch counts finished optimizer steps."""

    def __init__(self, max_lr: float, min_lr: float, warmup_steps: float, decay_steps: int, kind: str):
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_steps, self.decay_steps, self.kind = warmup_steps, decay_steps, kind
        super().__init__(learning_rate=max_lr, last_epoch=-1)

    def get_lr(self) -> float:
        # Before the optimizer step number last_epoch + 1.
        return learning_rate_at(self.last_epoch + 1, self.max_lr, self.min_lr,
                                self.warmup_steps, self.decay_steps, self.kind)


def build_schedule(args: Arguments) -> WarmupDecaySchedule:
    return WarmupDecaySchedule(
        max_lr=args.learning_rate,
        min_lr=args.min_learning_rate,
        warmup_steps=args.effective_warmup_steps,
        decay_steps=args.decay_steps or args.max_steps,
        kind=args.lr_scheduler_type,
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
