"""Pipeline worker: fleet's PipelineLayer + train_batch vs a single process.

    compat_pipeline_worker.py PP SCHEDULE [SCHEDULE ...]   (SCHEDULE: 1f1b | interleave)

A stack of tanh(Linear) blocks (every block initialised from fixed arrays, so
each stage builds exactly the reference's blocks) is trained for STEPS
train_batch calls (AdamW + ClipGradByGlobalNorm through
fleet.distributed_optimizer) on the same global batches as the single-process
reference, which runs in this same process. "interleave" is Paddle's
PipelineParallelWithInterleave (num_virtual_pipeline_stages=2, pp > 2 only).
"""

import sys
import time

from worker_common import Checks, fleet, init_fleet, max_err, np, paddle, randn

from paddle.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer

PP, SCHEDULES = int(sys.argv[1]), sys.argv[2:]
STEPS, WIDTH, MICRO_BATCH = 5, 8, 2
ACCUMULATE = 2 * PP  # micro-batches per step
BLOCKS = 2 * PP  # one block per (stage, virtual stage) chunk when interleaving
GLOBAL_BATCH = MICRO_BATCH * ACCUMULATE

hcg, strategy, init_seconds = init_fleet(
    pp_degree=PP, pipeline_configs={"accumulate_steps": ACCUMULATE, "micro_batch_size": MICRO_BATCH}
)
rng = np.random.RandomState(0)
weights = [
    (rng.randn(WIDTH, WIDTH).astype("float32") * 0.5, rng.randn(WIDTH).astype("float32") * 0.1) for _ in range(BLOCKS)
]
batches = [(randn([GLOBAL_BATCH, WIDTH], 3000 + s), randn([GLOBAL_BATCH, WIDTH], 4000 + s)) for s in range(STEPS)]


class Block(paddle.nn.Layer):
    def __init__(self, index):
        super().__init__()
        self.index = index
        w, b = weights[index]
        self.linear = paddle.nn.Linear(
            WIDTH,
            WIDTH,
            weight_attr=paddle.ParamAttr(initializer=paddle.nn.initializer.Assign(w)),
            bias_attr=paddle.ParamAttr(initializer=paddle.nn.initializer.Assign(b)),
        )

    def forward(self, x):
        return paddle.tanh(self.linear(x))


def make_optimizer(parameters):
    clip = paddle.nn.ClipGradByGlobalNorm(clip_norm=0.2)
    return paddle.optimizer.AdamW(
        learning_rate=0.02, parameters=parameters, weight_decay=0.01, epsilon=1e-3, grad_clip=clip
    )


def reference():
    model = paddle.nn.Sequential(*[Block(i) for i in range(BLOCKS)])
    optimizer = make_optimizer(model.parameters())
    losses = []
    for x, y in batches:
        loss = paddle.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        losses.append(float(loss))
    return losses, {block.index: block for block in model}


reference_losses, reference_blocks = reference()


def check(schedule):
    virtual = 2 if schedule == "interleave" else 1
    pipe = PipelineLayer(
        layers=[LayerDesc(Block, i) for i in range(BLOCKS)],
        num_stages=PP,
        topology=hcg.topology(),  # without it PipelineLayer assumes mp=1 (wrong stages with mp > 1)
        loss_fn=paddle.nn.MSELoss(),
        num_virtual_pipeline_stages=virtual,
        seg_method="layer:Block",
    )
    model = fleet.distributed_model(pipe)
    optimizer = fleet.distributed_optimizer(make_optimizer(pipe.parameters()))
    start = time.monotonic()
    losses = [float(model.train_batch([x, y], optimizer).reshape([])) for x, y in batches]
    seconds_per_step = (time.monotonic() - start) / STEPS
    blocks = [layer for layer in pipe.sublayers() if isinstance(layer, Block)]
    out = {f"loss_{i}": abs(a - b) for i, (a, b) in enumerate(zip(losses, reference_losses))}
    out["params"] = max(
        max_err(getattr(b.linear, name), getattr(reference_blocks[b.index].linear, name))
        for b in blocks
        for name in ("weight", "bias")
    )
    info[schedule] = {
        "class": type(model).__name__,
        "blocks": sorted(b.index for b in blocks),
        "s_per_step": round(seconds_per_step, 4),
    }
    return out


info = {}
checks = Checks()
for schedule in SCHEDULES:
    checks.run(schedule, check, schedule)
checks.write(
    init_seconds=round(init_seconds, 3), info=info, reference_losses=reference_losses, stage=hcg.get_stage_id()
)
