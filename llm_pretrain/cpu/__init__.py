"""Running on CPU: the compatibility layer that fills in what Paddle's CPU build lacks, and thread defaults.

    compat.py   every Paddle workaround in one place (each with the Paddle source line it works around),
                applied only when the device is CPU (parallel/distributed.py calls apply_cpu_compat)
    threads.py  threads per process and MKL's fast path, set before Paddle is imported; what the
                machine has (cores, vendor) and which Paddle build is installed, read without importing it
    kernel_standins.py  a testing aid: CPU stand-ins of the GPU-only kernels (flash attention, fused rotary,
                fused RMSNorm, fast LayerNorm) behind Paddle's bindings, installed only on CPU and only with
                LLM_PRETRAIN_KERNEL_STANDINS=1 (standin_switch.py reads it without importing Paddle)

May import: llm_pretrain.errors, llm_pretrain.arguments, models. Nothing else of llm_pretrain: every
package may use it.
"""
