"""Model definition (Llama family) and weight loaders (GGUF, HF safetensors)."""
