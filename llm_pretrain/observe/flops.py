"""Model FLOPs of a training step per token, device peaks, and MFU.

The formula
-----------
Only matrix products are counted, at 2 FLOPs per multiply-accumulate. For a
decoder layer with hidden size h, sequence length s, `a` query heads of size
d = h/a, `g` key/value heads (g < a: grouped-query attention), MLP width f,
the forward pass costs per token:

    q and output projections     2 * 2 h (a d)        = 4 h^2
    k and v projections          2 * 2 h (g d)        = 4 h g d   (GQA shrinks only these)
    attention q k^T and p v      2 * 2 s (a d)        = 4 s h     (full s^2, see below)
    MLP, SwiGLU (gate, up, down) 2 * 3 h f            = 6 h f     (LLaMA, Baichuan, Qwen)
    MLP, GELU (up, down)         2 * 2 h f            = 4 h f     (GPT-3, Bloom; f = 4h)

plus the output head 2 h V once per token (tied or not: the product is done
either way; the embedding lookup is free). Backward costs twice the forward
(gradients of the inputs and of the weights), so one training step is 3x the
forward: with h = a d, g = a and a GELU 4h MLP this is Megatron-LM's
72 L h^2 (1 + s/(6h) + V/(12 L h)) per token (Narayanan et al. 2021, eq. 3,
without its recompute pass).

Choices, and why:

* Attention counts the full s x s score matrix, not the causal half. This is
  the convention of Megatron-LM and of PaddleNLP's own TFLOPs figures, so the
  numbers compare with published tables; `causal_attention=True` gives the
  half that a causal flash-attention kernel really computes.
* Packed documents with document masks (reset_attention_mask): a query attends only to keys of its own
  document, so with documents of mean length L the attention work is min(L, s)/s of that without them
  (documents of equal length L: s/L causal triangles of L^2/2 pairs against one of s^2/2). `mean_document_length`
  scales the core attention by that ratio (both conventions above), for model and hardware FLOPs alike: the
  masked pairs are neither useful work nor computed by kernels that skip them (FlashMask skips the tiles a
  mask removes entirely, the ring its blocks; on GPU tiles of 128 rows, so this is the count for documents
  much longer than a tile; the plain CPU path computes the whole s x s and only masks). Documents of
  unequal lengths attend to E[L^2]/E[L] keys on average, more than E[L]: give that for a skewed mix.
* Per family, only the matrix shapes differ. Biases (GPT-3, Bloom, Qwen's
  q/k/v), norms, rotary/ALiBi/learned positions, softmax, activations and the
  residual adds are O(h) or O(s a) elementwise work per token, below 0.5% of
  the total for any model worth measuring (llama-7b at s=4096: ~0.3%), and
  are left out as in Megatron and PaddleNLP. Baichuan2's normalized head
  costs V h once per step, not per token.
* DeepSeek-V3's multi-head latent attention has no head_dim = h/a: its projections are counted by their
  shapes and its q k^T over qk_nope + qk_rope (192) per head, p v over v_head_dim (128)
  (`latent_attention_flops_per_token`); its multi-token-prediction block (eh_proj, one decoder layer, the
  shared head) is one more forward per token (`mtp_forward_flops_per_token`).
* Qwen v1's Hugging Face config lists twice the real MLP width
  (`intermediate_size // 2` per projection); `ModelConfig.intermediate_size`
  is always the real width, so Qwen counts as a SwiGLU model with that width.
* Recompute re-runs part of the forward inside the backward pass: the whole
  layer ("full"), the attention block, i.e. projections and core attention
  ("full_attn"), or only the core attention ("core_attn"). The head is never
  recomputed. "Model FLOPs" (`model_flops_per_token`, used for MFU) never
  include recompute -- recomputing is extra work, not progress; "hardware
  FLOPs" (`training_flops_per_token` with a granularity) do.

MFU is model TFLOPs per card divided by the card's peak dense throughput for
the run's dtype (`PEAK_TFLOPS`). A CPU has no datasheet figure here: its peak
is measured on the spot by `measure_cpu_peak_tflops()`: the best timed fp32
matrix product of Paddle and NumPy on all cores (see `cpu_matmul_benchmark`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import time

from llm_pretrain.cpu.threads import cpu_count, cpu_vendor, cpuinfo_field  # noqa: F401 (perf and scripts read them here)
from models.config import ModelConfig

RECOMPUTE_GRANULARITIES = ("full", "full_attn", "core_attn")


# ----------------------------------------------------------------------------- FLOPs per token
def mlp_matrices(config: ModelConfig) -> int:
    """Weight matrices of size h x f in the MLP: 3 for SwiGLU (gate, up, down), 2 for the GELU MLP."""
    return 3 if config.uses_swiglu else 2


def activated_mlp_width(config: ModelConfig) -> int:
    """The MLP width a token passes through. Mixture of experts: its k experts and the shared one
    (the router's h x E product is O(h E), negligible as the norms): Mixtral-8x7B 2 x 14336,
    Qwen1.5-MoE-A2.7B 4 x 1408 + 5632. Model FLOPs thus count the activated parameters, as the
    "A2.7B" / "12.9B active" figures of the model cards."""
    if config.is_moe:
        return config.num_experts_per_tok * config.expert_intermediate_size + config.shared_expert_intermediate_size
    return config.intermediate_size


def latent_attention_flops_per_token(config: ModelConfig, keys: int) -> tuple[int, int]:
    """Multi-head latent attention's forward (projections, core attention) per token (models/mla.py): the
    projections by their shapes, q_a [h, q_lora], q_b [q_lora, a (nope + rope)], kv_a_proj_with_mqa
    [h, kv_lora + rope], kv_b [kv_lora, a (nope + v)], o [a v, h]; q k^T over nope + rope per head and p v over
    v_head_dim (DeepSeek-V3: 192 and 128, not hidden / heads = 56)."""
    c, h, a = config, config.hidden_size, config.num_attention_heads
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    projections = 2 * (h * c.q_lora_rank + c.q_lora_rank * a * qk + h * (c.kv_lora_rank + c.qk_rope_head_dim)
                       + c.kv_lora_rank * a * (c.qk_nope_head_dim + c.v_head_dim) + a * c.v_head_dim * h)
    return projections, 2 * keys * a * qk + 2 * keys * a * c.v_head_dim


def layer_forward_flops_per_token(config: ModelConfig, seq_length: int, causal_attention: bool = False,
                                  mean_document_length: int | None = None) -> dict[str, float]:
    """Forward FLOPs of one decoder layer per token, by part (see the module docstring). The MLP is the
    activated one of an MoE layer (`dense_layer_mlp_correction` adds the difference of dense layers)."""
    h, d = config.hidden_size, config.head_dim
    q_width = config.num_attention_heads * d
    kv_width = config.num_key_value_heads * d
    keys = seq_length if mean_document_length is None else min(mean_document_length, seq_length)
    core_attention = 2 * 2 * keys * q_width
    projections = 2 * (2 * h * q_width + 2 * h * kv_width)
    if config.uses_mla:
        projections, core_attention = latent_attention_flops_per_token(config, keys)
    if causal_attention:
        core_attention /= 2
    return {
        "projections": projections,
        "core_attention": core_attention,
        "mlp": 2 * mlp_matrices(config) * h * activated_mlp_width(config),
    }


def dense_layer_mlp_correction(config: ModelConfig) -> int:
    """Forward FLOPs per token to add to num_hidden_layers x the activated MLP for the dense layers of a
    mixture of experts (DeepSeek-V3's first first_k_dense_replace, ERNIE 4.5 MoE's outside its interval): their
    MLP is intermediate_size wide. 0 when every layer is MoE, or the dense width equals the activated one
    (DeepSeek-V3: 18432 = 8 x 2048 + 2048; ERNIE-4.5-21B-A3B: 12288 = 6 x 1536 + 2 x 1536, 300B-A47B: 28672 =
    8 x 3584)."""
    if not config.is_moe:
        return 0
    dense_layers = config.num_hidden_layers - config.moe_layer_count
    return dense_layers * 2 * mlp_matrices(config) * config.hidden_size * (
        config.intermediate_size - activated_mlp_width(config))


def mtp_forward_flops_per_token(config: ModelConfig, parts: dict[str, float]) -> float:
    """DeepSeek-V3's multi-token-prediction module per token (models/decoder.py MTPLayer; report sec. 2.2):
    eh_proj [2h, h] over [embedding; hidden], one more decoder layer (`parts`, an MoE layer when its index
    num_hidden_layers is one) and the shared output head over the vocabulary; its embedding is a lookup.
    0 without MTP."""
    if not config.num_nextn_predict_layers:
        return 0
    h = config.hidden_size
    layer = sum(parts.values())
    if config.is_moe and not config.is_moe_layer(config.num_hidden_layers):
        layer += 2 * mlp_matrices(config) * h * (config.intermediate_size - activated_mlp_width(config))
    return config.num_nextn_predict_layers * (2 * 2 * h * h + layer + 2 * h * config.vocab_size)


def training_flops_per_token(config: ModelConfig, seq_length: int, recompute_granularity: str | None = None,
                             recomputed_layers: int | None = None, causal_attention: bool = False,
                             mean_document_length: int | None = None) -> float:
    """FLOPs of forward + backward (+ recompute, if a granularity is given) per trained token.

    recomputed_layers: how many layers recompute (default all; fewer with
    no_recompute_layers or pp_recompute_interval).
    """
    if recompute_granularity is not None and recompute_granularity not in RECOMPUTE_GRANULARITIES:
        raise ValueError(f"recompute_granularity {recompute_granularity!r}; allowed: {RECOMPUTE_GRANULARITIES}")
    layers = config.num_hidden_layers
    parts = layer_forward_flops_per_token(config, seq_length, causal_attention, mean_document_length)
    head_forward = 2 * config.hidden_size * config.vocab_size
    forward = layers * sum(parts.values()) + head_forward
    # (+ 0 leaves every model without dense MoE layers or MTP bit-identical)
    forward += dense_layer_mlp_correction(config) + mtp_forward_flops_per_token(config, parts)
    total = 3 * forward  # forward + backward (2x: input and weight gradients)

    recomputed = {
        None: 0,
        "full": sum(parts.values()),
        "full_attn": parts["projections"] + parts["core_attention"],
        "core_attn": parts["core_attention"],
    }[recompute_granularity]
    total += (layers if recomputed_layers is None else recomputed_layers) * recomputed
    if config.num_nextn_predict_layers and recompute_granularity in ("full_attn", "core_attn"):
        # the MTP block is not wrapped by the whole-layer recompute (CausalLM.forward), but its attention is
        # its DecoderLayer's, which recomputes at the attention granularities
        total += config.num_nextn_predict_layers * recomputed
    return float(total)


def model_flops_per_token(config: ModelConfig, seq_length: int, causal_attention: bool = False,
                          mean_document_length: int | None = None) -> float:
    """The FLOPs per token that count for MFU: forward + backward, never the recompute."""
    return training_flops_per_token(config, seq_length, None, causal_attention=causal_attention,
                                    mean_document_length=mean_document_length)


def recompute_flops_args(config: ModelConfig) -> dict:
    """training_flops_per_token's recompute arguments from a config's runtime options (hardware FLOPs)."""
    if not config.recompute:
        return {"recompute_granularity": None}
    layers = [i for i in range(config.num_hidden_layers) if i not in set(config.no_recompute_layers or [])]
    return {"recompute_granularity": config.recompute_granularity, "recomputed_layers": len(layers)}


# ----------------------------------------------------------------------------- device peaks
# Peak dense (no 2:4 sparsity) tensor throughput per card in TFLOPs, from NVIDIA's
# datasheets. "fp32" is plain FP32 on CUDA cores; "tf32" the tensor-core path
# that Paddle uses for float32 matmuls on Ampere and newer (FLAGS_allow_tf32_cublas,
# on by default). Keys are matched against the CUDA device name, most specific first.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # H100/H800 SXM5: H100 datasheet (nvidia.com/en-us/data-center/h100): BF16/FP16 1979
    # with sparsity -> 989.4 dense, TF32 494.7 dense, FP32 66.9. H800 has the same compute.
    "H100 SXM": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    # H100/H800 PCIe: same datasheet, PCIe column: BF16 756 dense, TF32 378, FP32 51.2.
    "H100 PCIE": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "H800 PCIE": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2},
    # H100 NVL (per GPU): datasheet 1671 BF16 sparse -> 835.5 dense, TF32 417.5, FP32 60.
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H800": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    # H200: H100 SXM compute with more memory (H200 datasheet).
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    # H20 (China export): BF16 148, TF32 74, FP32 44 (NVIDIA H20 product brief).
    "H20": {"bf16": 148.0, "fp16": 148.0, "tf32": 74.0, "fp32": 44.0},
    # A100 (SXM4 and PCIe, 40/80 GB): A100 datasheet: BF16/FP16 312, TF32 156, FP32 19.5.
    # A800 is the export variant with the same compute (only NVLink is slower).
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "A800": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    # A30: datasheet BF16 165, TF32 82, FP32 10.3.
    "A30": {"bf16": 165.0, "fp16": 165.0, "tf32": 82.0, "fp32": 10.3},
    # A10: datasheet BF16 125, TF32 62.5, FP32 31.2.
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    # L40S: datasheet BF16 362.05 dense (733 sparse), TF32 183, FP32 91.6.
    "L40S": {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
    # L4: datasheet BF16 121 dense (242 sparse), TF32 60, FP32 30.3.
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    # V100 (Volta): fp16 tensor cores only, no bf16/tf32. SXM2 125 / 15.7, PCIe 112 / 14 (datasheet).
    "V100-PCIE": {"fp16": 112.0, "fp32": 14.0},
    "V100S": {"fp16": 130.0, "fp32": 16.4},
    "V100": {"fp16": 125.0, "fp32": 15.7},
    # T4: datasheet FP16 65, FP32 8.1.
    "T4": {"fp16": 65.0, "fp32": 8.1},
    # GeForce RTX 4090 (Ada whitepaper): FP16/BF16 with FP32 accumulate 165.2 dense, TF32 82.6, FP32 82.6.
    "RTX 4090": {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6},
    # GeForce RTX 3090 (Ampere GA102 whitepaper): FP16/BF16 with FP32 accumulate 71, TF32 35.6, FP32 35.6.
    "RTX 3090": {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6},
}

# CUDA device names spell variants differently ("NVIDIA H100 80GB HBM3" is the SXM part,
# "Tesla V100-PCIE-32GB", "NVIDIA A800-SXM4-80GB"): patterns over the upper-cased name,
# most specific first, each naming a PEAK_TFLOPS key.
_DEVICE_PATTERNS = (
    (r"H100.*PCIE", "H100 PCIE"), (r"H800.*PCIE", "H800 PCIE"), (r"H100.*NVL", "H100 NVL"),
    (r"H100", "H100 SXM"), (r"H800", "H800"), (r"H200", "H200"), (r"\bH20\b", "H20"),
    (r"A100", "A100"), (r"A800", "A800"), (r"\bA30\b", "A30"), (r"\bA10\b", "A10"),
    (r"L40S", "L40S"), (r"\bL4\b", "L4"),
    (r"V100S", "V100S"), (r"V100.*PCIE", "V100-PCIE"), (r"V100", "V100"), (r"\bT4\b", "T4"),
    (r"RTX 4090", "RTX 4090"), (r"RTX 3090", "RTX 3090"),
)
DTYPES = ("bf16", "fp16", "tf32", "fp32")


def normalize_dtype(dtype: str) -> str:
    return {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}.get(
        str(dtype).lower(), str(dtype).lower())


def match_device(device_name: str) -> str | None:
    """The PEAK_TFLOPS key for a CUDA device name, or None if the card is not in the table."""
    name = device_name.upper().replace("_", " ")
    for pattern, key in _DEVICE_PATTERNS:
        if re.search(pattern, name):
            return key
    return None


def device_peak_tflops(device_name: str, dtype: str) -> float | None:
    """Peak dense TFLOPs of one card of this CUDA device name at this dtype, or None if unknown.

    dtype: "bf16", "fp16", "tf32" or "fp32" (bfloat16/float16/float32 also accepted).
    "fp32" on a card with tensor-core TF32 returns the TF32 peak, since Paddle runs
    float32 matmuls as TF32 there by default; ask for "tf32"/"fp32" explicitly through
    PEAK_TFLOPS if you disabled it. For a CPU ("cpu..."), the measured peak of this machine.
    """
    dtype = normalize_dtype(dtype)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
    if device_name.lower().startswith("cpu"):
        return measure_cpu_peak_tflops() if dtype == "fp32" else None
    key = match_device(device_name)
    if key is None:
        return None
    peaks = PEAK_TFLOPS[key]
    if dtype == "fp32" and "tf32" in peaks:
        return peaks["tf32"]
    return peaks.get(dtype)


# ----------------------------------------------------------------------------- MFU
def mfu(tflops_per_card: float, peak_tflops: float) -> float:
    """Model FLOPs utilization: achieved model TFLOPs per card / peak TFLOPs per card, in [0, 1].

    Raises ValueError for a non-positive peak, negative throughput, or a result
    above 1: a card cannot beat its peak, so that means a wrong peak (e.g. a CPU
    measured while busy) or a wrong FLOPs count, and showing it clamped to 100%
    would hide the error. Callers that must not fail show "n/a" instead.
    """
    if not peak_tflops or peak_tflops <= 0:
        raise ValueError(f"peak TFLOPs must be positive, got {peak_tflops}")
    if tflops_per_card < 0:
        raise ValueError(f"achieved TFLOPs must be >= 0, got {tflops_per_card}")
    value = tflops_per_card / peak_tflops
    if value > 1:
        raise ValueError(f"MFU {value:.1%} is above 100%: achieved {tflops_per_card:.4g} TFLOPs/card exceeds "
                         f"the peak {peak_tflops:.4g}; the peak or the FLOPs count is wrong")
    return value


# ----------------------------------------------------------------------------- CPU peak
def _best_tflops(matmul, size: int, min_seconds: float, min_repeats: int = 2) -> float:
    """Best (not mean: the peak is what the hardware *can* do) throughput of repeated n x n products."""
    matmul()  # warm-up: thread pools, page faults, kernel selection
    best, spent, repeats = float("inf"), 0.0, 0
    while repeats < min_repeats or spent < min_seconds:
        start = time.perf_counter()
        matmul()
        elapsed = time.perf_counter() - start
        best, spent, repeats = min(best, elapsed), spent + elapsed, repeats + 1
    return 2 * size**3 / best / 1e12


@contextlib.contextmanager
def _all_cores_for_blas(threads: int):
    """Paddle's (MKL/OpenMP) and NumPy's BLAS thread pools at `threads` for the block, then back.

    Both run with fewer by default: importing Paddle pins OMP_NUM_THREADS to 1 when it is
    unset (paddle/base/__init__.py, __bootstrap__), and Paddle's CPU matmul then runs on
    one core; NumPy's OpenBLAS takes its thread count from the environment when it loads.
    NumPy's pool is raised through threadpoolctl when that is installed (it is optional).
    Yields the thread counts the two libraries ran with (None: not known).
    """
    from paddle.base import core

    counts = {"paddle_threads": threads, "numpy_threads": None}
    limiter = contextlib.nullcontext()
    try:
        from threadpoolctl import threadpool_info, threadpool_limits

        limiter = threadpool_limits(limits=threads, user_api="blas")
    except ImportError:
        threadpool_info = None
    core.set_num_threads(threads)
    try:
        with limiter:
            if threadpool_info is not None:
                pools = [p["num_threads"] for p in threadpool_info() if "numpy" in p.get("filepath", "")]
                counts["numpy_threads"] = max(pools) if pools else None
            yield counts
    finally:
        core.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))  # what Paddle runs with otherwise


@functools.lru_cache(maxsize=None)
def cpu_matmul_benchmark(size: int = 2048, min_seconds: float = 0.5) -> dict:
    """Timed fp32 n x n matrix products with Paddle and with NumPy's BLAS, in this process, on every core.

    Returns {"paddle_tflops", "numpy_tflops", "peak_tflops" (the better of both), "library" (the
    one that reached it), "size", "cpus", "paddle_threads", "numpy_threads", "cpu_vendor",
    "mkl_debug_cpu_type"}. Cached per process and size: the machine does not change.

    Paddle's CPU matmul is Intel MKL (the mklml library bundled with the wheel). On AMD CPUs
    that MKL picks a generic SSE kernel, about 3x slower than its AVX2 one, unless
    MKL_DEBUG_CPU_TYPE=5 was in the environment when MKL loaded (Paddle 3.3.1 on a 2-core
    AMD EPYC: 0.025 TFLOPs on one core as is, 0.12-0.15 on both cores with the variable; NumPy's
    OpenBLAS: 0.15-0.18). The peak is the best of both libraries, so it is what the hardware can
    do; how close a run gets to it depends on how Paddle was set up (benchmarks/cpu_speed.md).
    """
    import numpy as np
    import paddle

    rng = np.random.default_rng(0)
    a_np = rng.standard_normal((size, size), dtype=np.float32)
    b_np = rng.standard_normal((size, size), dtype=np.float32)
    previous_device = paddle.get_device()
    paddle.set_device("cpu")
    try:
        with _all_cores_for_blas(cpu_count()) as threads:
            a, b = paddle.to_tensor(a_np), paddle.to_tensor(b_np)
            # .numpy() of one element forces the product to finish (CPU kernels are synchronous anyway).
            paddle_tflops = _best_tflops(lambda: paddle.matmul(a, b)[0, 0].numpy(), size, min_seconds)
            numpy_tflops = _best_tflops(lambda: a_np @ b_np, size, min_seconds)
    finally:
        paddle.set_device(previous_device)
    return {"paddle_tflops": paddle_tflops, "numpy_tflops": numpy_tflops,
            "peak_tflops": max(paddle_tflops, numpy_tflops),
            "library": "paddle" if paddle_tflops >= numpy_tflops else "numpy", "size": size, "cpus": cpu_count(),
            **threads, "cpu_vendor": cpu_vendor(), "mkl_debug_cpu_type": os.environ.get("MKL_DEBUG_CPU_TYPE")}


def measure_cpu_peak_tflops(size: int = 2048) -> float:
    """This machine's fp32 matmul peak in TFLOPs (all cores, the faster of Paddle and NumPy).

    The hardware can do at least what its best BLAS achieves, so the faster of the two
    libraries is the peak; a run using Paddle's slower CPU kernels then shows a low MFU,
    which is the honest answer. Measure it while the machine is otherwise idle.
    """
    return cpu_matmul_benchmark(size)["peak_tflops"]
