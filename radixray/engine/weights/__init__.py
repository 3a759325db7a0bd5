"""Model weights: loading (safetensors, GGUF), their layout, weight-update sessions and the trainer's sync group."""
