"""amp_master_grad's float32 gradients on CPU, for the workers that train through the real trainer.

On GPU, bf16/fp16 O2 with amp_master_grad has Precision.prepare register fleet's main_grad hooks and wrap
the optimizer in MixPrecisionOptimizer (precision.keep_master_grads). CPU has no half precision, so
Precision.prepare does nothing there; within `fp32_master_grads()` it also runs keep_master_grads on the
float32 weights (as tests/workers/precision_worker.py does by hand): every gradient then lives in
param.main_grad and goes through fleet's main_grad paths (hybrid optimizer, clips, sharding). Float32 master
gradients change no number, so such a run must train like the same run without them.
"""

from __future__ import annotations


class fp32_master_grads:
    """Within the block, Precision.prepare keeps fleet's float32 master gradients on float32 weights;
    `seen()`: how many of the model's parameters (and of its experts) hold a main_grad afterwards."""

    def __enter__(self):
        from llm_pretrain.parallel import precision

        self.original, self.hooked = precision.Precision.prepare, []

        def prepare(precision_self, model, optimizer, layout):
            model, optimizer = self.original(precision_self, model, optimizer, layout)
            self.hooked = list(model.parameters())
            return model, precision.keep_master_grads(model, optimizer, "bfloat16")

        precision.Precision.prepare = prepare
        return self

    def __exit__(self, *exc):
        from llm_pretrain.parallel import precision

        precision.Precision.prepare = self.original

    def seen(self) -> dict:
        with_main_grad = [p for p in self.hooked if getattr(p, "main_grad", None) is not None]
        return {"params": len(self.hooked), "with_main_grad": len(with_main_grad),
                "experts_with_main_grad": sum(getattr(p, "expert_parallel", False) for p in with_main_grad)}
