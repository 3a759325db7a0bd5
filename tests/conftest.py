import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# Loopback only: Ray must never advertise the external interface in tests.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Most tests compare with Hugging Face's fp32 outputs: engines here default to exact=true
# (engine/precision.py); test_default_precision.py tests the fast default itself.
os.environ["RADIXRAY_EXACT"] = "1"
# Compiled decode graphs check every C++ op's output sizes and strides against its fake
# (kernels/fake_ops.py) in tests; served graphs skip the checks (compiled_decode.py).
os.environ["RADIXRAY_COMPILE_SIZE_ASSERTS"] = "1"
# ... and check every guard of a graph the split guards let run (guard_split.py).
os.environ["RADIXRAY_COMPILE_CHECK_GUARDS"] = "1"
# Ray's dashboard probes cloud metadata (HTTP to 169.254.169.254, DNS for
# metadata.google.internal) and may report usage to usage-stats.ray.io: traced in
# docs/multinode.md. Every HTTP(S) proxy points at a loopback port nothing listens on (the
# discard port), so those attempts are refused on this machine; loopback addresses are
# never proxied, and gRPC uses no proxy at all.
_NOWHERE = "http://127.0.0.1:9"
for _name, _value in (("RAY_USAGE_STATS_ENABLED", "0"), ("RAY_USAGE_STATS_REPORT_URL", _NOWHERE),
                      ("http_proxy", _NOWHERE), ("https_proxy", _NOWHERE),
                      ("HTTP_PROXY", _NOWHERE), ("HTTPS_PROXY", _NOWHERE), ("grpc_proxy", ""),
                      ("no_proxy", "localhost,127.0.0.1,127.0.0.2,::1"),
                      ("NO_PROXY", "localhost,127.0.0.1,127.0.0.2,::1")):
    os.environ[_name] = _value


def _tiny_model_dir(kind: str):
    """A session fixture: the folder of a random-weight ``kind`` model (model_fixtures.tiny_config)."""
    def folder(tmp_path_factory):
        from model_fixtures import build_tiny_model
        return build_tiny_model(kind, str(tmp_path_factory.mktemp(f"tiny-{kind}")))
    folder.__doc__ = f"Folder of a tiny random-weight {kind} model: safetensors, config, tokenizer."
    return pytest.fixture(scope="session")(folder)


tiny_llama_dir = _tiny_model_dir("llama")
tiny_qwen3_dir = _tiny_model_dir("qwen3")
tiny_qwen2_dir = _tiny_model_dir("qwen2")
tiny_qwen3_moe_dir = _tiny_model_dir("qwen3_moe")
tiny_qwen2_moe_dir = _tiny_model_dir("qwen2_moe")  # with a shared expert
tiny_mixtral_dir = _tiny_model_dir("mixtral")


@pytest.fixture(scope="session")
def lora_adapters(tiny_llama_dir, tmp_path_factory):
    """Two PEFT adapters of the tiny Llama, ``alpha`` (rank 4) and ``beta`` (rank 8, rsLoRA),
    on every projection: name -> folder (model_fixtures.LORA_ADAPTERS)."""
    from model_fixtures import make_lora_adapters
    return make_lora_adapters(tiny_llama_dir, str(tmp_path_factory.mktemp("lora-adapters")))


@pytest.fixture(scope="session")
def smollm2_refs():
    """The default model's test prompts as token ids and transformers' greedy references for
    them, computed once a session (model_fixtures.smollm2_references)."""
    from model_fixtures import smollm2_references
    return smollm2_references()


@pytest.fixture(scope="module")
def eng(tiny_llama_dir):
    """An fp32 engine over the tiny Llama that checks KV conservation after every step."""
    from radixray import Engine
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=8192,
                check_kv_conservation=True) as engine:
        yield engine
        engine.check_kv_conservation()


def pytest_collection_modifyitems(config, items):
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
