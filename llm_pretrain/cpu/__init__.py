"""Running on CPU: the compatibility layer that fills in what Paddle's CPU build lacks, and thread defaults.

    compat.py   every Paddle workaround in one place (each with the Paddle source line it works around),
                applied only when the device is CPU (parallel/distributed.py calls apply_cpu_compat)
    threads.py  threads per process and MKL's fast path, set before Paddle is imported; what the
                machine has (cores, vendor) and which Paddle build is installed, read without importing it

May import: llm_pretrain.errors, llm_pretrain.arguments, models. Nothing else of llm_pretrain: every
package may use it.
"""
