"""Files in and out: GGUF reading (gguf_model, gguf_keys), the synthetic model writer, prompts, traces, atomic writes."""
