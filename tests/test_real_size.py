"""Parallel layouts at real sizes, through a checkpoint and resume: llama-real trains exactly like one process.

llama-real (hidden 1024, 2 layers, vocabulary 8320) is above the sizes where Paddle's sharding
changes behaviour: stage 3 slices parameters of more than 2**20 elements (its MLP matrices have
2.9M), stage 2 keeps parameters of more than 2**23 out of its gradient buffer (embedding and head:
8.5M). Each layout trains 4 steps, stops with a checkpoint after step 2 and resumes from it; per-step
loss, grad norm and final weights must equal one uninterrupted process within 1e-5 (fp32), with a
weight decay large enough that decaying other parameters than one process would show.

The runs are `scripts/gpu_selfcheck.py`'s, launched once here as the script (so CI runs the GPU
self-check's code path on CPU), on the device of LLM_PRETRAIN_TEST_DEVICE (cpu by default). Its bf16
cases exist only when that device is gpu: Paddle's CPU build has no bf16 training kernels, so on
CPU they are not collected at all (rather than skipped).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from launch_utils import REPO_ROOT
from llm_pretrain.selfcheck.rows import layout_output
from parity_utils import DEVICE, SAVE_STEP, TOLERANCE, run_record, train_records

SELFCHECK = REPO_ROOT / "scripts" / "gpu_selfcheck.py"
# cp2sd2_stage2 and sep2sd2_stage3 (one launch): ring attention at this size, and the sum over the sep group
# (llm_pretrain/parallel/distributed.py sum_sharded_gradients_over_sep_group) of stage 2's gradients kept out of its
# buffer (embedding and head) and of stage 3's slices (the MLP matrices, embedding and head).
# Stages 1 and 2 at this size train under tp2 (tp2sd2_stage1, tp2sd2_stage2: the same group-sharded code over the
# sharding pair, with the tensor-parallel slices), so the self-check's sd2_stage1 and sd2_stage2 rows (one launch
# of about 45 s) are not repeated here; stage 3 alone stays, for its slices (below). Nor is dp2 (a launch of about 42 s
# of the suite's wall time): its plain all-reduce of whole gradients is what every sharded layout here also does for
# the parameters it does not slice, and the self-check keeps its dp2 row (`--layouts dp2`).
LAYOUTS = ["sd2_stage3", "tp2sd2_stage1", "tp2sd2_stage2", "sep2", "cp2sd2_stage2", "sep2sd2_stage3"]
DTYPES = ["fp32", "bf16"] if DEVICE == "gpu" else ["fp32"]
# Scripts import the package as installed, or from the clone through PYTHONPATH (they do not edit sys.path).
SCRIPT_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def selfcheck(tmp_path_factory):
    work = tmp_path_factory.mktemp("real_size")
    result = subprocess.run([sys.executable, str(SELFCHECK), "--device", DEVICE, "--layouts", ",".join(LAYOUTS),
                             "--dtypes", ",".join(DTYPES), "--out", str(work)],
                            capture_output=True, text=True, timeout=1800, cwd=REPO_ROOT, env=SCRIPT_ENV)
    results = work / "results.json"
    assert results.exists(), result.stdout[-3000:] + result.stderr[-5000:]
    rows = {(row["layout"], row["dtype"]): row for row in json.loads(results.read_text()) if row["kind"] == "parity"}
    yield SimpleNamespace(work=work, rows=rows, result=result)
    shutil.rmtree(work / "runs", ignore_errors=True)  # about 0.5 GB of checkpoints per run


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_one_process_through_resume(selfcheck, layout, dtype):
    row = selfcheck.rows[layout, dtype]
    assert row["passed"], f"{row}\n{selfcheck.result.stderr[-5000:]}"
    if dtype == "fp32":
        assert max(row["loss"], row["grad_norm"], row["weights"]) <= TOLERANCE
    output = layout_output(selfcheck.work, layout, dtype)
    with open(output / "train_log.jsonl", encoding="utf-8") as f:
        starts = [r["start_step"] for r in map(json.loads, f) if r["event"] == "run"]
    assert starts == [0, SAVE_STEP], "the second part must resume from the checkpoint"
    assert [r["step"] for r in train_records(output)] == [1, 2, 3, 4]
    run = run_record(output)
    assert run["strategy"] == layout and run["dtype"] == dtype and run["device"] == DEVICE


def test_stage3_saves_and_resumes_sliced_parameters(selfcheck):
    """The size matters: under stage 3 the matrices above 2**20 elements (MLP, embedding, head) are
    held as flat slices, one per sharding rank, and saved so (tensors.index.json: each rank's file
    holds boxes covering its contiguous half of the flattened tensor); q_proj (exactly 2**20
    elements) and the norms are held whole on every rank and written once."""
    index = json.loads((layout_output(selfcheck.work, "sd2_stage3", "fp32") / "checkpoint-4"
                        / "tensors.index.json").read_text())["tensors"]
    files = ["tensors.rank00000.safetensors", "tensors.rank00001.safetensors"]

    def by_file(name):
        return {f: [s for s in index[name]["slices"] if s["file"] == f] for f in files}

    sliced = {name.removesuffix("/moment1_0") for name in index
              if name.endswith("/moment1_0") and all(by_file(name).values())}
    matrices = {f"layers.{i}.mlp.{name}_proj.weight" for i in (0, 1) for name in ("gate", "up", "down")}
    assert sliced == matrices | {"embeddings.word_embeddings.weight", "lm_head.weight"}, sorted(sliced)
    for name in sorted(sliced):
        for tensor in (name, f"{name}/moment1_0", f"{name}/moment2_0"):
            shape = index[tensor]["shape"]
            # Rank r holds the flat range [r*L, (r+1)*L) of the flattened tensor, L about half of it
            # (Paddle pads the flattened parameter to 2L, with alignment: group_sharded_stage3.py).
            length = sum(math.prod(s["shape"]) for s in by_file(tensor)[files[0]])
            assert length == pytest.approx(math.prod(shape) / 2, rel=1e-3), (tensor, length)
            for rank, file in enumerate(files):
                starts = sorted((int(np.ravel_multi_index(s["offsets"], shape)), math.prod(s["shape"]))
                                for s in by_file(tensor)[file])
                assert starts[0][0] == rank * length, (tensor, file, starts[0])
                assert all(a + n == b for (a, n), (b, _) in zip(starts, starts[1:])), (tensor, file)
                assert sum(n for _, n in starts) == min(length, math.prod(shape) - rank * length), (tensor, file)
    # q_proj has exactly 2**20 elements: whole (one slice, the whole tensor), like the norms.
    for name in ("layers.0.self_attn.q_proj.weight", "layers.0.input_layernorm.weight"):
        for tensor in (name, f"{name}/moment1_0"):
            (only,) = index[tensor]["slices"]
            assert only["shape"] == index[tensor]["shape"] and only["offsets"] == [0] * len(only["shape"]), tensor
    assert math.prod(index["layers.0.self_attn.q_proj.weight"]["shape"]) == 2**20
    # Every rank's replicas (the whole parameters on both ranks) were checked identical.
    with open(layout_output(selfcheck.work, "sd2_stage3", "fp32") / "train_log.jsonl", encoding="utf-8") as f:
        checks = [r["replica_check"] for r in map(json.loads, f) if r["event"] == "summary"]
    assert len(checks) == 2 and all(c["identical"] and c["replica_groups"] > 0 for c in checks), checks


def test_selfcheck_prints_the_table(selfcheck):
    assert selfcheck.result.returncode == 0, selfcheck.result.stderr[-5000:]
    lines = selfcheck.result.stdout.splitlines()
    assert "| row | kind | processes | dtype | loss | grad norm | weights |" in "\n".join(lines)
    for layout in LAYOUTS:
        for dtype in DTYPES:
            assert any(line.startswith(f"| {dtype}:{layout} | ") and line.endswith("| pass |")
                       for line in lines), f"no passing row for {layout} {dtype}"
    assert (selfcheck.work / "selfcheck.md").read_text().startswith("| row |")


# ----------------------------------------------------------------------------- no launch
def test_weight_decay_applies_to_the_same_parameters_as_stage3_slices():
    """Stage 3 hands the optimizer "slice@<name>" for every parameter above 2**20 elements."""
    import paddle

    from llm_pretrain.arguments import Arguments
    from llm_pretrain.parallel.optim import build_optimizer, build_schedule
    from models.decoder import CausalLM
    from models.registry import ARCHITECTURES

    args = Arguments(max_steps=4, weight_decay=0.1)
    paddle.seed(0)
    model = CausalLM(ARCHITECTURES["llama-tiny"])
    decides = build_optimizer(args, model, build_schedule(args))._apply_decay_param_fun
    decayed = {name for name, param in model.canonical_named_parameters() if decides(param.name)}
    assert decayed == {name for name, _ in model.canonical_named_parameters() if "norm" not in name}
    for _, param in model.canonical_named_parameters():
        assert decides("slice@" + param.name) == decides(param.name), param.name


def test_the_device_of_the_parity_tests_comes_from_the_environment(monkeypatch, tmp_path):
    import launch_utils

    monkeypatch.setenv("LLM_PRETRAIN_TEST_DEVICE", "gpu")
    assert launch_utils.device_under_test() == "gpu"
    monkeypatch.setenv("LLM_PRETRAIN_TEST_DEVICE", "tpu")
    with pytest.raises(ValueError, match="allowed values are cpu, gpu"):
        launch_utils.device_under_test()
    monkeypatch.delenv("LLM_PRETRAIN_TEST_DEVICE")
    assert launch_utils.device_under_test() == "cpu"

    # What a GPU launch runs: one GPU per process, IEEE fp32 and deterministic kernels, no thread pin.
    launched = []

    class FakeLauncher:
        pid, returncode = 0, 0

        def __init__(self, cmd, env, **kwargs):
            launched.append((cmd, env))

        def communicate(self, timeout=None):
            return b"", None

    with monkeypatch.context() as patched:
        patched.setattr(launch_utils.parity.subprocess, "Popen", FakeLauncher)
        patched.delenv("OMP_NUM_THREADS", raising=False)
        launch_utils.launch("worker.py", 4, log_dir=tmp_path / "gpu", device="gpu")
        launch_utils.launch("worker.py", 2, log_dir=tmp_path / "cpu")
    (gpu_cmd, gpu_env), (cpu_cmd, cpu_env) = launched
    assert gpu_cmd[gpu_cmd.index("--devices") + 1] == "0,1,2,3" and "--nproc_per_node" not in gpu_cmd
    assert gpu_env["NVIDIA_TF32_OVERRIDE"] == "0" and gpu_env["FLAGS_cudnn_deterministic"] == "1"
    assert "OMP_NUM_THREADS" not in gpu_env
    assert cpu_cmd[cpu_cmd.index("--nproc_per_node") + 1] == "2" and "--devices" not in cpu_cmd
    assert cpu_env["OMP_NUM_THREADS"] == "1" and "NVIDIA_TF32_OVERRIDE" not in cpu_env

    # The parity helpers read it once: runs are configured for, and launched on, that device.
    probe = ("import json, parity_utils as p; calls = []; p.parity.launch = lambda *a, **k: calls.append(k['device']) or "
             "type('R', (), {'check': lambda self: self})(); p.run_launch(2, [], __import__('pathlib').Path("
             f"{str(tmp_path)!r}), 'probe'); print(json.dumps([p.DEVICE, p.base_arguments("
             "{'tokenizer': 't', 'input_dir': 'd'}, __import__('pathlib').Path('.'))['device'], calls[0]]))")
    for device in ("gpu", "cpu"):
        env = {**os.environ, "LLM_PRETRAIN_TEST_DEVICE": device, "PYTHONPATH": str(REPO_ROOT / "tests")}
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=REPO_ROOT)
        assert json.loads(out.stdout.strip().splitlines()[-1]) == [device] * 3, out.stderr[-2000:]


@pytest.mark.parametrize("args, message", [
    (["--device", "cpu", "--dtypes", "bf16"], "error: --dtypes: bf16 and fp16 need --device gpu"),
    (["--device", "cpu", "--layouts", "dp2,dp3"], "error: --layouts: unknown layout dp3; allowed: dp2, tp2"),
    (["--device", "cpu", "--dtypes", "fp8"], "error: --dtypes: 'fp8'; allowed"),
    (["--device", "tpu"], "error: argument --device: invalid choice"),
    # A CPU build of Paddle (here); the default device is gpu.
    ([], r"error: --device gpu: this Paddle build has no CUDA"),
    (["--device", "gpu", "--layouts", "dp2"], r"error: --device gpu: this Paddle build has no CUDA"),
])
def test_selfcheck_bad_input_is_one_line_exit_2(tmp_path, args, message):
    env = {**SCRIPT_ENV, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, str(SELFCHECK), *args, "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=120)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert len(out.stderr.strip().splitlines()) == 1 and re.match(message, out.stderr.strip()), out.stderr
    assert not (tmp_path / "out").exists(), "nothing may run before the input is checked"
