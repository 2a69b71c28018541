"""llm-pretrain: pretraining LLMs with Paddle's fleet hybrid-parallel API."""
