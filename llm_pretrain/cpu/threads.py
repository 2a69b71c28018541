"""Fast CPU defaults, set before Paddle is imported: threads per process and MKL's fast path.

As is, Paddle trains on CPU far below what the machine can do (benchmarks/cpu_speed.md):

* `import paddle` sets OMP_NUM_THREADS=1 when it is unset (paddle/base/__init__.py,
  `__bootstrap__`), so every kernel, the matrix products included, runs on one core.
* The MKL bundled with Paddle's wheel (libmklml_intel.so) takes a generic SSE code path on
  non-Intel CPUs unless MKL_DEBUG_CPU_TYPE=5 is in the environment when it loads (2.8x on a
  2-core AMD EPYC together with the threads). On Intel CPUs it picks its fast path itself.
* Since Paddle 2.6, `transpose`, `reshape`, slicing and friends return strided views
  (FLAGS_use_stride_kernel, default true, paddle/common/flags.cc), and the first kernel that needs
  a contiguous input copies the view with the generic StridedCopyKernel
  (paddle/phi/kernels/cpu/strided_copy_kernel.cc), which computes every element's offset one at a
  time: 12 ms for the [4, 16, 256, 64] transpose of attention's q on 2 cores, where the transpose
  kernel the flag falls back to takes 1.2 ms (benchmarks/cpu_speed.md). Attention transposes
  q, k, v and its output forward and backward, so the flag off is 19-23 % of a training step at
  width 1024. With it off, Paddle 2.5's semantics: these functions return new tensors.

So when the run is on CPU and the user has not set them, `apply_cpu_defaults` sets
OMP_NUM_THREADS to the cores of this node divided by the training processes on this node
(PADDLE_LOCAL_SIZE, which `paddle.distributed.launch` gives every process it starts),
FLAGS_use_stride_kernel=0 and, on AMD CPUs with an MKL build of Paddle, MKL_DEBUG_CPU_TYPE=5; it
returns one line saying so, which the trainer writes into the run record and prints when training
starts. (Paddle reads FLAGS_* from the environment when it is imported.) A value the user set always
wins. GPU runs are left as they are.

Paddle's bootstrap prints a warning for any OMP_NUM_THREADS above 1 (paddle/base/__init__.py:152-164 in
Paddle 3.3.1: `WARNING: OMP_NUM_THREADS set to N, not 1 ... PLEASE USE OMP_NUM_THREADS WISELY.`, two
print() calls to sys.stderr, no flag or variable turns it off; only an unset or 1 stays silent, which
is the single-core speed this module exists to avoid). `import_paddle` imports Paddle without those two
lines when the value is the one set here, and with them when it is the user's own.

Nothing here imports Paddle (that would be too late). Two questions need answers without it:

* Is the run on CPU? The `device` argument when given; otherwise what Paddle's own default
  would be (llm_pretrain.run.preflight.choose_device: gpu when Paddle is compiled with CUDA),
  read from the build's version file: paddle/version/__init__.py is written when the wheel is
  built and holds `cuda_version = 'False'` (and `hip_version = None`) in CPU builds; it is what
  `paddle.version.cuda()` returns. Found through importlib's spec of the package, not imported.
  If the file cannot be read, the `paddlepaddle-gpu` distribution being installed decides.
* Did the user set OMP_NUM_THREADS? Under `paddle.distributed.launch` every process inherits
  OMP_NUM_THREADS=1 even when the user set nothing: the launcher imported Paddle, whose
  bootstrap wrote it into the environment it passes on. The user's own environment is then the
  one the launcher started with, which Linux keeps in /proc/<launcher pid>/environ (later
  changes of a process' environment do not appear there). When that file cannot be read, the
  inherited value is taken as the user's (nothing is changed).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import io
import os
import re
import sys

THREADS = "OMP_NUM_THREADS"
MKL_CPU_TYPE = "MKL_DEBUG_CPU_TYPE"
STRIDED_VIEWS = "FLAGS_use_stride_kernel"
LAUNCHERS = ("paddle.distributed.launch", "fleetrun")  # what starts processes with PADDLE_LOCAL_SIZE set
# Printed by Paddle 3.3.1's __bootstrap__ (paddle/base/__init__.py:156-164) for OMP_NUM_THREADS > 1.
PADDLE_THREADS_WARNING = (
    "WARNING: OMP_NUM_THREADS set to {threads}, not 1. The computation speed will not be optimized if you use data "
    "parallel. It will fail if this PaddlePaddle binary is compiled with OpenBlas since OpenBlas does not support "
    "multi-threads.\nPLEASE USE OMP_NUM_THREADS WISELY.\n")

_set_here: dict[str, str] = {}  # what apply_cpu_defaults set in this process


def paddle_build() -> dict:
    """{"gpu": built with CUDA or ROCm, "mkl": built with MKL} of the installed Paddle, without importing it."""
    spec = importlib.util.find_spec("paddle")
    text = ""
    if spec is not None and spec.submodule_search_locations:
        try:
            with open(os.path.join(list(spec.submodule_search_locations)[0], "version", "__init__.py"),
                      encoding="utf-8") as f:
                text = f.read()
        except OSError:
            pass
    fields = dict(re.findall(r"^(\w+)\s*=\s*'?([^'\n]*)'?\s*$", text, flags=re.MULTILINE))
    if "cuda_version" in fields:
        gpu = fields["cuda_version"] not in ("False", "") or fields.get("hip_version", "None") not in ("None", "False", "")
    else:
        try:
            importlib.metadata.version("paddlepaddle-gpu")
            gpu = True
        except importlib.metadata.PackageNotFoundError:
            gpu = False
    return {"gpu": gpu, "mkl": fields.get("with_mkl", "ON") == "ON"}


def launcher_environment(environ: dict) -> dict | None:
    """The environment `paddle.distributed.launch` started with (the user's), when this process is its child."""
    if "PADDLE_LOCAL_SIZE" not in environ:
        return None
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/cmdline", "rb") as f:
            command = f.read().decode(errors="replace")
        if not any(name in command for name in LAUNCHERS):
            return None
        with open(f"/proc/{parent}/environ", "rb") as f:
            entries = f.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


def cpu_defaults(device: str | None, environ: dict, launcher_environ: dict | None, cpu_count: int,
                 vendor: str | None, build: dict) -> dict[str, str]:
    """The variables to set (name -> value) for this run; empty on GPU or when the user set them all.

    device: the `device` argument (None: Paddle's default, gpu when the build has CUDA).
    environ: this process' environment; launcher_environ: the launcher's starting one (the
    user's) when this process was started by paddle.distributed.launch, else None.
    """
    if (device or ("gpu" if build["gpu"] else "cpu")) != "cpu":
        return {}
    user = launcher_environ if launcher_environ is not None else environ
    settings = {}
    if THREADS not in user:
        local_processes = max(1, int(environ.get("PADDLE_LOCAL_SIZE") or 1))
        settings[THREADS] = str(max(1, cpu_count // local_processes))
    if STRIDED_VIEWS not in user:
        settings[STRIDED_VIEWS] = "0"
    if MKL_CPU_TYPE not in user and vendor == "AuthenticAMD" and build["mkl"]:
        settings[MKL_CPU_TYPE] = "5"
    return settings


def apply_cpu_defaults(device: str | None) -> str | None:
    """Set cpu_defaults(...) in os.environ (before Paddle is imported); the one line to print, or None.

    Does nothing once Paddle is imported: its thread count and MKL are set up by then.
    """
    if "paddle" in sys.modules:
        return None

    settings = cpu_defaults(device, dict(os.environ), launcher_environment(dict(os.environ)), cpu_count(),
                            cpu_vendor(), paddle_build())
    if not settings:
        return None
    os.environ.update(settings)
    _set_here.update(settings)
    why = {THREADS: f"{cpu_count()} cores / {os.environ.get('PADDLE_LOCAL_SIZE', '1')} process(es) on this node",
           STRIDED_VIEWS: "copies of transposed views by the transpose kernel",
           MKL_CPU_TYPE: "MKL's AVX2 kernels on this AMD CPU"}
    return ("cpu defaults: " + ", ".join(f"{k}={v} ({why[k]})" for k, v in settings.items())
            + "; set them yourself to override")


def import_paddle():
    """`import paddle`, without Paddle's OMP_NUM_THREADS warning when the value is the one apply_cpu_defaults
    set on an MKL build (the toolkit divided the cores itself; the warning's failure is OpenBLAS's). A value
    the user set keeps its warning, and so does an OpenBLAS build. Anything else Paddle prints while
    loading is shown as it is."""
    if "paddle" in sys.modules:
        return sys.modules["paddle"]
    ours = _set_here.get(THREADS)
    if ours is None or os.environ.get(THREADS) != ours or not paddle_build()["mkl"]:
        import paddle

        return paddle
    real, captured = sys.stderr, io.StringIO()
    sys.stderr = captured  # the warning is two print(..., file=sys.stderr) calls
    try:
        import paddle
    finally:
        sys.stderr = real
        shown = captured.getvalue().replace(PADDLE_THREADS_WARNING.format(threads=int(ours)), "", 1)
        if shown:
            real.write(shown)
            real.flush()
    return paddle


# ----------------------------------------------------------------------------- the machine
def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpuinfo_field(key: str) -> str | None:
    """The first `key : value` of /proc/cpuinfo ("vendor_id", "model name", ...); None elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_vendor() -> str | None:
    """"GenuineIntel", "AuthenticAMD", ... (None off Linux)."""
    return cpuinfo_field("vendor_id")
