"""The commands installed with the package (pyproject.toml [project.scripts]); scripts/<name>.py runs the same.

    llm-pretrain       llm_pretrain/run_pretrain.py   train from a JSON argument file
    llm-plan           cli/plan.py                    predict memory and speed, search a layout
    llm-prepare-data   cli/prepare_data.py            JSON lines -> prefix.bin/.idx
    llm-benchmark      cli/benchmark.py               launch argument files, write the performance table
    llm-perf-table     cli/perf_table.py              the performance table of finished runs
    llm-export-hf      checkpoint/hf_export.py        a checkpoint -> a Hugging Face directory

May import everything in llm_pretrain; nothing in llm_pretrain imports it.
"""
