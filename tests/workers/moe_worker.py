"""Expert parallelism under a real launch: trainings, then the mechanism watched on one layer stack.

    python -m paddle.distributed.launch --nproc_per_node 2 tests/workers/moe_worker.py runs.json

runs.json: {"runs": [run_pretrain.py argument lists, one layout], "experts": E, "ep": ep,
"fp32_master_grad": [indices of the runs trained with fleet's master gradients]}. After the
runs (fleet is initialized by the first), each rank builds a mixtral-tiny stack with
expert_parallel_degree ep and, on the same tokens, the whole model in this process, and reports:
which experts it holds, the rows its all-to-alls carried in forward and backward, and the largest
differences of its loss and gradients from the whole model's on both ranks' tokens.

fp32_master_grad: those runs keep fleet's float32 master gradients (tests/workers/fp32_master_grads.py); the
result's "master_grads" says, per run index, how many parameters (and experts) held a main_grad.
"""

import json
import sys

import numpy as np  # noqa: E402
from fp32_master_grads import fp32_master_grads  # noqa: E402
import paddle  # noqa: E402

from llm_pretrain.run_pretrain import main  # noqa: E402
from models.decoder import CausalLM  # noqa: E402
from models.registry import ARCHITECTURES  # noqa: E402
from models.weights import init_weights  # noqa: E402

BATCH, SEQ = 2, 16


def observe(ep: int) -> dict:
    import paddle.distributed as dist

    rank, ranks = dist.get_rank(), dist.get_world_size()
    config = ARCHITECTURES["mixtral-tiny"].replace(seq_length=SEQ, expert_parallel_degree=ep)
    rng = np.random.default_rng(5)
    all_tokens = rng.integers(0, config.vocab_size, size=(ranks * BATCH, SEQ))
    mine = paddle.to_tensor(all_tokens[rank * BATCH:(rank + 1) * BATCH], dtype="int64")

    model = CausalLM(config)
    init_weights(model, config, seed=3)
    model.train()
    loss = model(mine, mine)
    loss.backward()
    held = sorted({int(name.split(".experts.")[1].split(".")[0]) for name, _ in model.named_parameters()
                   if ".experts." in name})
    rows = [layer.mlp.rows_sent for layer in model.layers]

    whole_config = config.replace(expert_parallel_degree=1)
    whole = CausalLM(whole_config)
    init_weights(whole, whole_config, seed=3)
    whole.train()
    tokens = paddle.to_tensor(all_tokens, dtype="int64")
    losses = [whole(tokens[r * BATCH:(r + 1) * BATCH], tokens[r * BATCH:(r + 1) * BATCH]) for r in range(ranks)]
    (paddle.add_n(losses) / ranks).backward()  # the mean over the ranks, as data parallelism
    whole_grads = dict(whole.named_parameters())
    grad_diff = {}
    for name, param in model.named_parameters():
        if ".experts." in name:  # an expert's gradient is final here (the replicated ones await DP's all-reduce)
            grad_diff[name] = float(np.abs(param.grad.numpy() - whole_grads[name].grad.numpy()).max())
    return {"rank": rank, "experts_held": held, "rows_per_layer": rows, "pairs_per_layer": BATCH * SEQ * 2,
            "loss_diff": abs(float(loss) - float(losses[rank])), "expert_grad_diff": max(grad_diff.values()),
            "expert_grad_max": max(float(np.abs(p.grad.numpy()).max()) for n, p in model.named_parameters()
                                   if ".experts." in n)}


if __name__ == "__main__":
    import contextlib

    with open(sys.argv[1]) as f:
        plan = json.load(f)
    master_grads = {}  # run index -> what fp32_master_grads saw
    for index, argv in enumerate(plan["runs"]):
        with fp32_master_grads() if index in plan.get("fp32_master_grad", []) else contextlib.nullcontext() as watch:
            code = main([str(a) for a in argv])
        if watch is not None:
            master_grads[index] = watch.seen()
        if code:
            sys.exit(code)
        if "paddle.distributed.fleet" in sys.modules:
            sys.modules["paddle.distributed.fleet"].fleet.user_defined_optimizer = None
    from launch_utils import write_result

    write_result({**(observe(plan["ep"]) if plan["ep"] else {"runs": len(plan["runs"])}),
                  "master_grads": master_grads})
    from llm_pretrain.run.run_control import exit_after_results

    exit_after_results(0)  # a rank of the ep2dp4 launch died with SIGSEGV at exit after its result (full run, 18:00)
