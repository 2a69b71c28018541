"""CPU defaults set before Paddle loads (llm_pretrain/cpu/threads.py): threads per process, MKL's fast path.

The decision (`cpu_defaults`) is tested on given environments; `apply_cpu_defaults` in fresh
processes, the launcher case once under a stand-in launcher and once under paddle.distributed.launch.
"""

import json
import os
import subprocess
import sys

from llm_pretrain.cpu.threads import cpu_defaults, paddle_build
from tests.launch_utils import REPO_ROOT

CPU_BUILD = {"gpu": False, "mkl": True}
GPU_BUILD = {"gpu": True, "mkl": True}
AMD, INTEL = "AuthenticAMD", "GenuineIntel"
STRIDES = "FLAGS_use_stride_kernel"


def test_cpu_run_without_user_values_gets_threads_and_mkl_switch():
    assert cpu_defaults("cpu", {}, None, 16, AMD, CPU_BUILD) == {"OMP_NUM_THREADS": "16", STRIDES: "0",
                                                           "MKL_DEBUG_CPU_TYPE": "5"}
    assert cpu_defaults(None, {}, None, 16, INTEL, CPU_BUILD) == {"OMP_NUM_THREADS": "16", STRIDES: "0"}  # Intel: MKL fast
    assert cpu_defaults("cpu", {}, None, 16, AMD, {"gpu": False, "mkl": False}) == {"OMP_NUM_THREADS": "16", STRIDES: "0"}
    # Cores are shared by the processes of the node (the launcher's PADDLE_LOCAL_SIZE), at least one each.
    assert cpu_defaults("cpu", {"PADDLE_LOCAL_SIZE": "4"}, {}, 16, INTEL, CPU_BUILD) == {"OMP_NUM_THREADS": "4", STRIDES: "0"}
    assert cpu_defaults("cpu", {"PADDLE_LOCAL_SIZE": "8"}, {}, 2, INTEL, CPU_BUILD) == {"OMP_NUM_THREADS": "1", STRIDES: "0"}


def test_user_values_win():
    user = {"OMP_NUM_THREADS": "3", "MKL_DEBUG_CPU_TYPE": "4", STRIDES: "1"}
    assert cpu_defaults("cpu", user, None, 16, AMD, CPU_BUILD) == {}
    assert cpu_defaults("cpu", {"OMP_NUM_THREADS": "3", STRIDES: "1"}, None, 16, AMD, CPU_BUILD) == {
        "MKL_DEBUG_CPU_TYPE": "5"}
    assert cpu_defaults("cpu", {"MKL_DEBUG_CPU_TYPE": "4"}, None, 16, AMD, CPU_BUILD) == {"OMP_NUM_THREADS": "16",
                                                                                          STRIDES: "0"}
    # Under the launcher the user's environment is the launcher's: the OMP_NUM_THREADS=1 its own
    # `import paddle` passed down is not the user's, an OMP_NUM_THREADS=1 the user gave it is.
    launched = {"PADDLE_LOCAL_SIZE": "2", "OMP_NUM_THREADS": "1"}
    assert cpu_defaults("cpu", launched, {}, 16, INTEL, CPU_BUILD) == {"OMP_NUM_THREADS": "8", STRIDES: "0"}
    assert cpu_defaults("cpu", launched, {"OMP_NUM_THREADS": "1"}, 16, INTEL, CPU_BUILD) == {STRIDES: "0"}


def test_gpu_runs_are_untouched():
    assert cpu_defaults("gpu", {}, None, 16, AMD, GPU_BUILD) == {}
    assert cpu_defaults(None, {}, None, 16, AMD, GPU_BUILD) == {}  # Paddle's default device on a CUDA build
    assert cpu_defaults("cpu", {}, None, 16, AMD, GPU_BUILD) == {"OMP_NUM_THREADS": "16", STRIDES: "0",
                                                           "MKL_DEBUG_CPU_TYPE": "5"}


def test_build_read_without_importing_paddle_agrees_with_paddle():
    code = ("import sys, json; from llm_pretrain.cpu.threads import paddle_build; b = paddle_build(); "
            "assert 'paddle' not in sys.modules; import paddle; "
            "print(json.dumps([b, paddle.is_compiled_with_cuda() or paddle.is_compiled_with_rocm(), paddle.version.mkl()]))")
    build, gpu, mkl = json.loads(subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                                                text=True, check=True).stdout.strip().splitlines()[-1])
    assert build == {"gpu": gpu, "mkl": mkl == "ON"}
    assert paddle_build() == build


PROBE = ("import json, os, sys; from llm_pretrain.cpu.threads import apply_cpu_defaults; "
         "line = apply_cpu_defaults(sys.argv[1] if sys.argv[1] != 'none' else None); "
         "print(json.dumps([line, os.environ.get('OMP_NUM_THREADS'), os.environ.get('MKL_DEBUG_CPU_TYPE'), "
         "os.environ.get('FLAGS_use_stride_kernel')]))")


def probe(device: str, env: dict, launcher: str | None = None) -> list:
    """apply_cpu_defaults(device) in a fresh process with exactly `env` (plus PYTHONPATH); [line, OMP, MKL, STRIDES]."""
    env = {**env, "PYTHONPATH": str(REPO_ROOT), "PATH": os.environ["PATH"]}
    command = [sys.executable, "-c", PROBE, device]
    if launcher:  # a parent whose command line names the launcher and which sets OMP_NUM_THREADS=1 as it does
        parent = (f"import os, subprocess, sys; os.environ['OMP_NUM_THREADS'] = '1'; "
                  f"sys.exit(subprocess.run({command!r}, env=dict(os.environ, PADDLE_LOCAL_SIZE='2')).returncode)")
        command = [sys.executable, "-c", parent, launcher]
    out = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_apply_sets_unset_values_keeps_the_users_and_says_so_once():
    from llm_pretrain.cpu.threads import cpu_count, cpu_vendor

    amd = cpu_vendor() == AMD and paddle_build()["mkl"]
    line, threads, mkl, strides = probe("cpu", {})
    assert threads == str(cpu_count()) and mkl == ("5" if amd else None) and strides == "0"
    assert line.startswith("cpu defaults: OMP_NUM_THREADS=") and "\n" not in line and "FLAGS_use_stride_kernel=0" in line
    assert probe("cpu", {"OMP_NUM_THREADS": "3", "MKL_DEBUG_CPU_TYPE": "4", STRIDES: "1"}) == [None, "3", "4", "1"]
    assert probe("gpu", {}) == [None, None, None, None]
    # Started by a launcher: its processes share the cores; the OMP_NUM_THREADS=1 it passes down is not the user's.
    assert probe("cpu", {}, launcher="paddle.distributed.launch")[1] == str(max(1, cpu_count() // 2))
    assert probe("cpu", {"OMP_NUM_THREADS": "1"}, launcher="paddle.distributed.launch")[1] == "1"
    # A parent that is not a launcher: the inherited value counts as the user's.
    assert probe("cpu", {}, launcher="not-a-launcher")[1] == "1"


def test_under_paddle_distributed_launch(tmp_path):
    from llm_pretrain.cpu.threads import cpu_count

    script = tmp_path / "probe.py"
    script.write_text(f"import sys; sys.argv[1:] = ['cpu']; exec({PROBE!r})\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS" and not k.startswith("PADDLE_")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    subprocess.run([sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir",
                    str(tmp_path / "log"), str(script)], cwd=REPO_ROOT, env=env, check=True, capture_output=True,
                   timeout=120)
    for rank in (0, 1):
        lines = (tmp_path / "log" / f"workerlog.{rank}").read_text().strip().splitlines()
        assert json.loads(lines[-1])[1] == str(max(1, cpu_count() // 2))


def test_paddle_takes_the_strided_view_switch_from_the_environment():
    """The switch only works if Paddle reads it at import: with it off, a transpose is a new tensor
    (its own memory), with Paddle's default a view of the same memory."""
    code = ("import json, sys; from llm_pretrain.cpu.threads import apply_cpu_defaults; apply_cpu_defaults('cpu'); "
            "import paddle; x = paddle.ones([2, 3]); y = x.transpose([1, 0]); "
            "print(json.dumps([paddle.get_flags(['FLAGS_use_stride_kernel'])['FLAGS_use_stride_kernel'], "
            "y.is_contiguous(), y.data_ptr() == x.data_ptr()]))")
    def run(env):
        env = {**env, "PYTHONPATH": str(REPO_ROOT), "PATH": os.environ["PATH"]}
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                             check=True).stdout
        return json.loads(out.strip().splitlines()[-1])
    assert run({}) == [False, True, False]  # our default: the transpose kernel writes a new tensor
    assert run({STRIDES: "1"}) == [True, False, True]  # the user's value wins: a strided view


def test_paddles_thread_warning_is_shown_for_the_users_value_only():
    """Paddle warns for any OMP_NUM_THREADS above 1 (paddle/base/__init__.py:152-164); import_paddle drops
    those two lines only when the value is the one apply_cpu_defaults set, never for the user's own."""
    from llm_pretrain.cpu.threads import cpu_count

    code = ("import os; from llm_pretrain.cpu.threads import apply_cpu_defaults, import_paddle; "
            "apply_cpu_defaults('cpu'); import_paddle(); print(os.environ['OMP_NUM_THREADS'])")
    def run(env):
        env = {**env, "PYTHONPATH": str(REPO_ROOT), "PATH": os.environ["PATH"]}
        return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              check=True)
    users = max(2, cpu_count())  # the same count the toolkit would choose (when there are 2 cores or more)
    shown = run({"OMP_NUM_THREADS": str(users)})
    assert shown.stdout.strip() == str(users)
    assert f"WARNING: OMP_NUM_THREADS set to {users}, not 1." in shown.stderr, shown.stderr
    assert "PLEASE USE OMP_NUM_THREADS WISELY." in shown.stderr
    ours = run({})
    assert ours.stdout.strip() == str(cpu_count())  # the toolkit's count reached Paddle
    # Kept on an OpenBLAS build (the failure it warns of is OpenBLAS's); one core: Paddle has nothing to say.
    assert ("OMP_NUM_THREADS" in ours.stderr) == (not paddle_build()["mkl"] and cpu_count() > 1), ours.stderr
