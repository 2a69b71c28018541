"""sharding_degree=2 worker: ZeRO stages 1, 2 and 3 on CPU processes vs a single process.

A small MLP is trained for STEPS AdamW steps with ClipGradByGlobalNorm (set
low enough to clip) on the same global batches; each rank gets its half of
every batch. Stage 1 is fleet's own (hybrid_configs sharding_degree=2 +
fleet.distributed_optimizer; also with sharding_configs.tensor_fusion), stages 2 and 3 are
paddle.distributed.sharding.group_sharded_parallel over the sharding group,
the way PaddleNLP's trainer uses them. The single-process reference runs in
this same process on the full batches.
"""

from worker_common import Checks, dist, fleet, init_fleet, max_err, paddle, randn

from paddle.distributed.sharding import group_sharded_parallel

STEPS, GLOBAL_BATCH = 5, 8
hcg, strategy, init_seconds = init_fleet(sharding_degree=2)
group = hcg.get_sharding_parallel_group()
n, r = group.nranks, group.rank
local = slice(r * GLOBAL_BATCH // n, (r + 1) * GLOBAL_BATCH // n)
batches = [(randn([GLOBAL_BATCH, 16], 1000 + s), randn([GLOBAL_BATCH, 4], 2000 + s)) for s in range(STEPS)]


def make_model():
    paddle.seed(7)
    return paddle.nn.Sequential(
        paddle.nn.Linear(16, 32), paddle.nn.Tanh(), paddle.nn.Linear(32, 32), paddle.nn.Tanh(), paddle.nn.Linear(32, 4)
    )


def make_optimizer(model):
    # epsilon=1e-3 makes the AdamW update depend on the gradient scale (with 1e-8 it is
    # nearly scale-free), so a wrong global norm or a sum-vs-mean slip changes the parameters
    # by ~1e-2 instead of ~1e-6.
    clip = paddle.nn.ClipGradByGlobalNorm(clip_norm=0.5)
    return paddle.optimizer.AdamW(
        learning_rate=0.02, parameters=model.parameters(), weight_decay=0.01, epsilon=1e-3, grad_clip=clip
    )


def train(model, optimizer, rows):
    losses = []
    for x, y in batches:
        loss = paddle.nn.functional.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        losses.append(loss.detach())
    return losses


def params(layer):
    return {name: p.detach().clone() for name, p in layer.state_dict().items()}


def grad_norm_before_clip():
    model = make_model()
    x, y = batches[0]
    paddle.nn.functional.mse_loss(model(x), y).backward()
    return float(paddle.sqrt(sum((p.grad**2).sum() for p in model.parameters())))


reference_model = make_model()
reference_losses = train(reference_model, make_optimizer(reference_model), slice(None))
reference = params(reference_model)


def compare(stage, losses, final):
    global_losses = []
    for loss in losses:  # the global-batch loss: mean of the per-rank means (equal halves)
        loss = loss.clone()
        dist.all_reduce(loss, group=group)
        global_losses.append(loss / n)
    out = {f"loss_{i}": max_err(a, b) for i, (a, b) in enumerate(zip(global_losses, reference_losses))}
    out["params"] = max(max_err(final[name], reference[name]) for name in reference)
    info.setdefault(stage, {})["param_change"] = max(
        max_err(make_model().state_dict()[name], reference[name]) for name in reference
    )
    return out


def check_stage1(stage, tensor_fusion=False):
    model = make_model()
    wrapped = fleet.distributed_model(model)
    if tensor_fusion:  # fused gradient/parameter buffers (tensor_fusion_helper)
        strategy.hybrid_configs["sharding_configs"].tensor_fusion = True
        optimizer = fleet.distributed_optimizer(make_optimizer(model), strategy=strategy)
    else:
        optimizer = fleet.distributed_optimizer(make_optimizer(model))
    out = compare(stage, train(wrapped, optimizer, local), params(model))
    info[stage]["optimizer"] = type(optimizer._inner_opt).__name__
    info[stage]["tensor_fusion"] = bool(optimizer._inner_opt.tensor_fusion)
    return out


def check_group_sharded(stage, level, **kwargs):
    model = make_model()
    wrapped, optimizer, _ = group_sharded_parallel(model, make_optimizer(model), level=level, group=group, **kwargs)
    info.setdefault(stage, {})["clip_class"] = type(optimizer._optim._grad_clip).__name__
    losses = train(wrapped, optimizer, local)
    if level == "p_g_os":
        wrapped.get_all_parameters()  # gather the sliced parameters back into full ones
    out = compare(stage, losses, params(model))
    # segment_size makes the weights really partitioned (smaller parameters stay whole)
    sliced = [p for p in model.parameters() if not hasattr(p, "unslice")] if level == "p_g_os" else []
    info[stage]["sliced_params"] = len(sliced)
    return out


info = {}
checks = Checks()
checks.run("stage1", check_stage1, "stage1")
checks.run("stage1_tensor_fusion", check_stage1, "stage1_tensor_fusion", tensor_fusion=True)
checks.run("stage2", check_group_sharded, "stage2", "os_g")
checks.run("stage3", check_group_sharded, "stage3", "p_g_os", segment_size=256)
checks.write(
    init_seconds=round(init_seconds, 3),
    reference_losses=[float(x) for x in reference_losses],
    grad_norm_step0=grad_norm_before_clip(),
    clip_norm=0.5,
    info=info,
)
