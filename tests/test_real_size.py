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
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from launch_utils import REPO_ROOT
from parity_utils import DEVICE, SAVE_STEP, TOLERANCE, layout_output, run_record, train_records

SELFCHECK = REPO_ROOT / "scripts" / "gpu_selfcheck.py"
LAYOUTS = ["dp2", "sd2_stage1", "sd2_stage2", "sd2_stage3", "tp2sd2_stage1", "tp2sd2_stage2"]
DTYPES = ["fp32", "bf16"] if DEVICE == "gpu" else ["fp32"]


@pytest.fixture(scope="module")
def selfcheck(tmp_path_factory):
    work = tmp_path_factory.mktemp("real_size")
    result = subprocess.run([sys.executable, str(SELFCHECK), "--device", DEVICE, "--layouts", ",".join(LAYOUTS),
                             "--dtypes", ",".join(DTYPES), "--out", str(work)],
                            capture_output=True, text=True, timeout=1800, cwd=REPO_ROOT)
    results = work / "results.json"
    assert results.exists(), result.stdout[-3000:] + result.stderr[-5000:]
    rows = {(row["layout"], row["dtype"]): row for row in json.loads(results.read_text())}
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
    """The size matters: under stage 3 each rank holds a flat slice of the matrices (written by both
    ranks into the layout-free checkpoint, llm_pretrain/dist_checkpoint.py), the norms whole (one rank)."""
    checkpoint = layout_output(selfcheck.work, "sd2_stage3", "fp32") / "checkpoint-4"
    tensors = json.loads((checkpoint / "tensors.index.json").read_text())["tensors"]

    def held_by_rank(name: str) -> dict[str, int]:
        """file -> elements of `name` that file (one rank's) holds."""
        held: dict[str, int] = {}
        for piece in tensors[name]["slices"]:
            held[piece["file"]] = held.get(piece["file"], 0) + int(np.prod(piece["shape"]))
        return held

    sliced = {name.rsplit("/", 1)[0] for name in tensors
              if name.endswith("/moment1_0") and len(held_by_rank(name)) == 2}
    matrices = {f"layers.{i}.mlp.{name}_proj.weight" for i in (0, 1) for name in ("gate", "up", "down")}
    assert sliced == matrices | {"embeddings.word_embeddings.weight", "lm_head.weight"}, sorted(sliced)
    # q_proj has exactly 2**20 elements: whole (on every rank, written by one), like the norms.
    assert len(held_by_rank("layers.0.self_attn.q_proj.weight/moment1_0")) == 1
    # Each rank keeps half of a matrix (Paddle's alignment padding is not written).
    for held in held_by_rank("layers.0.mlp.up_proj.weight/moment1_0").values():
        assert held == pytest.approx(1024 * 2816 / 2, rel=1e-3)


def test_selfcheck_prints_the_table(selfcheck):
    assert selfcheck.result.returncode == 0, selfcheck.result.stderr[-5000:]
    lines = selfcheck.result.stdout.splitlines()
    assert "| layout | processes | dtype | max loss difference |" in "\n".join(lines)
    for layout in LAYOUTS:
        for dtype in DTYPES:
            assert any(line.startswith(f"| {layout} | ") and f"| {dtype} |" in line and line.endswith("| pass |")
                       for line in lines), f"no passing row for {layout} {dtype}"
    assert (selfcheck.work / "selfcheck.md").read_text().startswith("| layout |")


# ----------------------------------------------------------------------------- no launch
def test_weight_decay_applies_to_the_same_parameters_as_stage3_slices():
    """Stage 3 hands the optimizer "slice@<name>" for every parameter above 2**20 elements."""
    import paddle

    from llm_pretrain.arguments import Arguments
    from llm_pretrain.optim import build_optimizer, build_schedule
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
        patched.setattr(launch_utils.subprocess, "Popen", FakeLauncher)
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
    probe = ("import json, parity_utils as p; calls = []; p.launch = lambda *a, **k: calls.append(k['device']) or "
             "type('R', (), {'check': lambda self: self})(); p.run_launch(2, [], __import__('pathlib').Path("
             f"{str(tmp_path)!r}), 'probe'); print(json.dumps([p.DEVICE, p.base_arguments("
             "{'tokenizer': 't', 'input_dir': 'd'}, __import__('pathlib').Path('.'))['device'], calls[0]]))")
    for device in ("gpu", "cpu"):
        env = {**os.environ, "LLM_PRETRAIN_TEST_DEVICE": device, "PYTHONPATH": str(REPO_ROOT / "tests")}
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=REPO_ROOT)
        assert json.loads(out.stdout.strip().splitlines()[-1]) == [device] * 3, out.stderr[-2000:]


@pytest.mark.parametrize("args, message", [
    (["--device", "cpu", "--dtypes", "bf16"], "error: --dtypes: bf16 needs --device gpu"),
    (["--device", "cpu", "--layouts", "dp2,dp3"], "error: --layouts: unknown layout dp3; allowed: dp2, tp2"),
    (["--device", "cpu", "--dtypes", "fp8"], "error: --dtypes: 'fp8'; allowed"),
    (["--device", "tpu"], "error: argument --device: invalid choice"),
    # A CPU build of Paddle (here), or a GPU build with no GPU visible.
    (["--device", "gpu", "--layouts", "dp2"],
     r"error: --(device gpu: this Paddle build has no CUDA|layouts need 2 GPUs, 0)"),
])
def test_selfcheck_bad_input_is_one_line_exit_2(tmp_path, args, message):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, str(SELFCHECK), *args, "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=120)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert len(out.stderr.strip().splitlines()) == 1 and re.match(message, out.stderr.strip()), out.stderr
    assert not (tmp_path / "out").exists(), "nothing may run before the input is checked"
