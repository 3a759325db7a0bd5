"""radixray: a Ray-native LLM serving and RL rollout engine."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["Engine", "EngineConfig", "EngineFailed", "SamplingParams", "build_app"]


def __getattr__(name: str):
    # Lazy, so `import radixray` stays cheap (no torch/transformers until used).
    if name == "Engine":
        from radixray.engine.engine import Engine
        return Engine
    if name == "EngineConfig":
        from radixray.engine.config import EngineConfig
        return EngineConfig
    if name == "EngineFailed":
        from radixray.engine.faults import EngineFailed
        return EngineFailed
    if name == "SamplingParams":
        from radixray.engine.sampling import SamplingParams
        return SamplingParams
    if name == "build_app":
        from radixray.serve.builder import build_app
        return build_app
    raise AttributeError(f"module 'radixray' has no attribute {name!r}")
