"""Model architectures written on radixray's layers, keyed by Hugging Face architecture name."""

from __future__ import annotations

from radixray.engine.models.llama import LlamaForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def model_class_for(config) -> type:
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    if getattr(config, "model_type", None) in ("llama", "mistral", "qwen2", "qwen3"):
        return LlamaForCausalLM
    raise ValueError(f"unsupported model architecture {archs or config.model_type!r}; "
                     f"supported: {sorted(MODEL_REGISTRY)}")
