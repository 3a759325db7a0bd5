"""Model architectures written on radixray's layers, keyed by Hugging Face architecture name."""

from __future__ import annotations

from radixray.engine.models.llama import LlamaForCausalLM
from radixray.engine.models.moe import MOE_MODEL_TYPES, MoeForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": MoeForCausalLM,
    "Qwen2MoeForCausalLM": MoeForCausalLM,
    "MixtralForCausalLM": MoeForCausalLM,
}


def model_class_for(config) -> type:
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    if getattr(config, "model_type", None) in ("llama", "mistral", "qwen2", "qwen3"):
        return LlamaForCausalLM
    if getattr(config, "model_type", None) in MOE_MODEL_TYPES:
        return MoeForCausalLM
    raise ValueError(f"unsupported model architecture {archs or config.model_type!r}; "
                     f"supported: {sorted(MODEL_REGISTRY)}")
