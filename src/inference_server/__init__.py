"""inference_server: a single-GPU LLM inference engine."""
