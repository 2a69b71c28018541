"""Mixed precision on GPU as PaddleNLP 2.8.1's Trainer does it; plain float32 on CPU.

    autocast            every forward (train, pipeline, evaluation) under the run's
                        paddle.amp.auto_cast with PaddleNLP's op lists
    O2                  half-precision weights, float32 master weights (paddle.amp.decorate)
    amp_master_grad     float32 gradients kept beside the half weights (fleet's
                        mix_precision_utils, one process too), or refused where that is unsafe
    fp16 loss scaling   one GradScaler whose overflow check is shared by every rank:
                        fleet.distributed_scaler (dp/tp/pp/stage 1) or GroupShardedScaler
                        (stages 2/3); the optimizer step and the LR schedule are skipped
                        together on every rank when any rank overflows

References: paddlenlp/trainer/trainer.py (_wrap_amp_model, _wrap_model,
autocast_smart_context_manager, the optimizer step in _inner_training_loop) and
paddle/distributed/fleet/scaler.py, fleet/meta_parallel/sharding/group_sharded_utils.py,
fleet/utils/mix_precision_utils.py of Paddle 3.3.1.
"""

from __future__ import annotations

import contextlib
from types import MethodType

import paddle

# check_master_grad decides whether a layout is valid, so it lives in llm_pretrain/parallel/layout.py (which has
# no Paddle import: the preflight runs it before Paddle loads); imported here for existing callers.
from llm_pretrain.parallel.layout import check_master_grad  # noqa: F401

# paddlenlp/trainer/trainer.py autocast_smart_context_manager: reductions and the (parallel)
# cross entropy stay in float32; under O2 the embedding lookup returns half precision too
# (Paddle's default lists keep lookup_table in float32, which would promote the residual stream).
AMP_BLACK_LIST = ("reduce_sum", "c_softmax_with_cross_entropy")
O2_WHITE_LIST = ("lookup_table", "lookup_table_v2")


def amp_op_lists(level: str) -> tuple[set[str], set[str]]:
    """(custom white list, custom black list) for paddle.amp.auto_cast at this AMP level."""
    return (set(O2_WHITE_LIST) if level == "O2" else set()), set(AMP_BLACK_LIST)


def loss_scaler_kind(layout) -> str:
    """Which overflow check the fp16 loss scaler needs in this layout.

    "local": one process (its own gradients are all there is).
    "distributed": fleet.distributed_scaler, found_inf all-reduced (MAX) over every rank before
        the step; fleet leaves pure data parallelism's scaler as it is, whose gradients are
        already all-reduced in backward (paddle/distributed/fleet/scaler.py, last lines).
    "group_sharded": GroupShardedScaler for sharding stages 2 and 3 (each rank holds a slice of
        the gradients; found_inf is all-reduced the same way).
    As paddlenlp/trainer/trainer.py _wrap_amp_model.
    """
    if not layout.distributed:
        return "local"
    return "group_sharded" if layout.sharding_stage in (2, 3) else "distributed"


def wrap_loss_scaler(scaler, layout):
    """The GradScaler with the overflow check of the layout (see loss_scaler_kind)."""
    kind = loss_scaler_kind(layout)
    if kind == "distributed":
        from paddle.distributed import fleet

        scaler = fleet.distributed_scaler(scaler)  # paddlenlp/trainer/trainer.py:418
    elif kind == "group_sharded":
        from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_utils import GroupShardedScaler

        scaler = GroupShardedScaler(scaler)  # paddlenlp/trainer/trainer.py:435
    return fix_scale_update(scaler)


def fix_scale_update(scaler):
    """The scaler with `_update_loss_scale` as its scale update (see there)."""
    scaler._update = MethodType(_update_loss_scale, scaler)
    return scaler


def _update_loss_scale(self):
    """paddle/amp/grad_scaler.py AmpScaler._update (Paddle 3.3.1, lines 457-478), without its
    message `float(self._scale)`: the scale has shape [1], and float() of a 1-element array
    raises TypeError under numpy >= 2.4 (our pin), which would end a run at its first overflow."""
    if not self._enable:
        return
    if self._cache_found_inf:
        self._incr_count = 0
        self._decr_count = self._decr_count + 1
        if self._decr_count == self._decr_every_n_nan_or_inf:
            self._scale = self._scale * self._decr_ratio
            self._decr_count = 0
    else:
        self._decr_count = 0
        self._incr_count = self._incr_count + 1
        if self._incr_count == self._incr_every_n_steps:
            self._scale = self._scale * self._incr_ratio
            self._incr_count = 0


def keep_master_grads(model, optimizer, dtype: str):
    """float32 gradients in param.main_grad, before fleet's wrappers (returns the optimizer to wrap).

    As paddlenlp/trainer/trainer.py _wrap_model under pipeline, tensor parallelism and sharding
    stage 1/2, and for one process (trainer.py:1763-1766, world_size == 1): fleet's
    mix_precision_utils hooks accumulate each gradient into main_grad, and an
    optimizer steps on main_grad; fleet's hybrid optimizer, its clip, its gradient all-reduce, the
    sequence-parallel hooks and the stage-2 gradient storage all read main_grad when it exists.
    """
    from paddle.distributed.fleet.utils import mix_precision_utils

    mix_precision_utils.MixPrecisionLayer(model, dtype=dtype)  # registers the hooks; the wrapper is not used
    return mix_precision_utils.MixPrecisionOptimizer(optimizer)


class Precision:
    """The run's precision: autocast, O2 decoration, master gradients and the fp16 loss scaler.

    On CPU everything is float32 (Paddle's CPU build has no half-precision kernels): autocast
    is a null context and there is no scaler. The scaler and its wrapping are still the same
    code as on GPU (tests enable a scaler on CPU to check the overflow handling).
    """

    def __init__(self, args, device: str):
        self.dtype = ("bfloat16" if args.bf16 else "float16" if args.fp16 else None) if device == "gpu" else None
        self.level = args.fp16_opt_level
        self.master_grad = bool(args.amp_master_grad) and self.dtype is not None and self.level == "O2"
        self.scale_loss = args.scale_loss  # the fp16 GradScaler's initial loss scale
        self.scaler = None
        self.scaler_kind = "local"

    def prepare(self, model, optimizer, layout):
        """Before fleet's wrappers (wrap_for_training): O2 weights, master gradients, the scaler."""
        if self.dtype is None:
            return model, optimizer
        if self.level == "O2":
            # paddlenlp/trainer/trainer.py _wrap_amp_model / _wrap_model: decorate without
            # master_grad; master gradients come from mix_precision_utils below, in one process too.
            # decorate's own master_grad would not do: its backward-final hook turns every .grad into
            # float32 (paddle/amp/auto_cast.py:677-703, 743), so the next micro-batch's bfloat16
            # gradient cannot be accumulated into it ("type of data (bfloat16) does not match (float32)").
            model, optimizer = paddle.amp.decorate(models=model, optimizers=optimizer, level="O2", dtype=self.dtype,
                                                   master_weight=True, master_grad=False)
        if self.master_grad:
            optimizer = keep_master_grads(model, optimizer, self.dtype)  # trainer.py:1763-1766 for one process
        if self.dtype == "float16":
            scaler = paddle.amp.GradScaler(init_loss_scaling=self.scale_loss)
            if self.master_grad:
                from paddle.distributed.fleet.utils import mix_precision_utils

                # paddlenlp/trainer/trainer.py:417 (patches the scaler to unscale main_grad). PaddleNLP's
                # one-process branch (trainer.py:442) leaves it out, but there too the gradients live in
                # main_grad (param.grad stays empty), which an unpatched unscale_ would never see.
                mix_precision_utils.MixPrecisionScaler(scaler)
            self.use_scaler(scaler, layout)
        return model, optimizer

    def use_scaler(self, scaler, layout) -> None:
        """Scale losses with this GradScaler, wrapped for the layout's cross-rank overflow check."""
        self.scaler = wrap_loss_scaler(scaler, layout)
        self.scaler_kind = loss_scaler_kind(layout)

    def autocast(self):
        """paddlenlp/trainer/trainer.py autocast_smart_context_manager."""
        if self.dtype is None:
            return contextlib.nullcontext()
        white, black = amp_op_lists(self.level)
        return paddle.amp.auto_cast(True, custom_white_list=white, custom_black_list=black, level=self.level,
                                    dtype=self.dtype)

    def unscale(self, optimizer) -> bool:
        """Unscale the gradients now, before the step, where that is safe; True when they are unscaled.

        Only a one-process scaler may: a layout's wrapped scaler checks overflow across the ranks
        inside its step (calling GradScaler.unscale_ would run the local check instead)."""
        if self.scaler is None:
            return True
        if self.scaler_kind != "local":
            return False
        self.scaler.unscale_(optimizer)
        return True

    def skip_step(self) -> None:
        """The trainer dropped this step (a non-finite loss) after `unscale` ran: end the scaler's step
        as its update() would after an overflow. unscale_ marks the optimizer UNSCALED until update()
        resets it (paddle/amp/grad_scaler.py:368-371, 887-892); without this the next step's unscale_
        raises "unscale_() has already been called". The dynamic scale counts the step as an overflow
        step when the gradients were not finite, as GradScaler.step + update would."""
        if self.scaler is not None and self.scaler_kind == "local":
            # What GradScaler.step records before update() (grad_scaler.py:849-855), read once on this rare path.
            self.scaler._cache_found_inf = bool(self.scaler._found_inf)
            self.scaler.update()

    def backward(self, loss) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, optimizer) -> bool:
        """One optimizer step; False when the fp16 scaler found inf/nan (on any rank) and skipped it."""
        if not self.scaler:
            optimizer.step()
            return True
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.optimizer_was_run()

    def optimizer_was_run(self) -> bool:
        """Whether the last scaler step updated the weights (paddlenlp/trainer/trainer.py:1045-1048)."""
        if self.scaler is None:
            return True
        found_inf = self.scaler._cache_found_inf  # a bool, or the found_inf tensor (stage-2 optimizer wrapper)
        if isinstance(found_inf, paddle.Tensor):
            found_inf = found_inf.numpy().reshape(-1)[0]
        return not bool(found_inf)
