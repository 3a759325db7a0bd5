"""PEFT LoRA adapters read from disk: ``adapter_config.json`` + ``adapter_model.safetensors``.

An adapter is kept in host memory as one (A ``[r, in]``, B ``[out, r]``, scaling) per
decoder layer and projection it targets; the adapter slots (lora_slots.py) copy it into
their stacked tensors when a batch needs it. Only the seven projections of a dense
Llama-family decoder are served: ``q_proj k_proj v_proj o_proj gate_proj up_proj
down_proj``. Anything the engine would not apply exactly (DoRA, trained biases,
``modules_to_save``, embedding or lm_head adapters) is refused by name.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
                          r"(?:\.[^.]+)?\.weight$")


@dataclass
class LoraAdapter:
    """One adapter in host memory: ``weights[(layer, module)] = (A [r, in], B [out, r])`` with
    ``scalings[(layer, module)]`` (lora_alpha / r, or / sqrt(r) with rsLoRA, per module
    when the config's rank or alpha pattern says so). ``rank``: its largest rank."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    scalings: dict[tuple[int, str], float] = field(repr=False)

    @property
    def modules(self) -> list[str]:
        return sorted({m for _, m in self.weights})


def _pattern_value(patterns: dict, key: str, default):
    """PEFT's rank_pattern / alpha_pattern: the value of the first pattern that ``key`` (the
    module's full name) ends with or matches."""
    for pattern, value in (patterns or {}).items():
        if key.endswith(pattern) or re.fullmatch(rf".*\.{pattern}$", key):
            return value
    return default


def _check_config(cfg: dict, name: str) -> None:
    bad = []
    if cfg.get("peft_type", "LORA") != "LORA":
        bad.append(f"peft_type {cfg.get('peft_type')!r} (only LORA)")
    if cfg.get("use_dora"):
        bad.append("use_dora")
    if cfg.get("bias", "none") != "none":
        bad.append(f"bias={cfg.get('bias')!r}")
    if cfg.get("modules_to_save"):
        bad.append(f"modules_to_save={cfg['modules_to_save']}")
    if bad:
        raise ValueError(f"LoRA adapter {name!r}: not supported: {', '.join(bad)}")


def group_lora_tensors(name: str, tensors, num_layers: int):
    """PEFT-named tensors (``...layers.<i>.self_attn.q_proj.lora_A.weight``) grouped as
    ``{(layer, module): {"A"|"B": tensor}}``, each key's module name before ``.lora_``, and
    each ``(key, half)``'s tensor name. ValueError naming the adapter and the tensor outside
    the served projections."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    full_names: dict[tuple[int, str], str] = {}
    tensor_names: dict[tuple[tuple[int, str], str], str] = {}
    for tname, t in tensors:
        m = _TENSOR_NAME.search(tname)
        if m is None or m.group(2) not in LORA_MODULES:
            raise ValueError(f"LoRA adapter {name!r}: tensor {tname!r} is not a LoRA weight of "
                             f"one of {list(LORA_MODULES)}")
        layer, module = int(m.group(1)), m.group(2)
        if layer >= num_layers:
            raise ValueError(f"LoRA adapter {name!r}: tensor {tname!r} names layer {layer}; "
                             f"the model has {num_layers}")
        halves.setdefault((layer, module), {})[m.group(3)] = t
        full_names[(layer, module)] = tname[:tname.index(".lora_")]
        tensor_names[((layer, module), m.group(3))] = tname
    return halves, full_names, tensor_names


def checked_update(old: LoraAdapter, tensors, num_layers: int) -> dict:
    """The PEFT-named ``tensors`` (or anything with a ``shape``: a shape check before a
    broadcast) grouped as by :func:`group_lora_tensors`, once each fits ``old``: ValueError
    naming the adapter and the tensor for a weight ``old`` does not have or a shape other
    than its (an update keeps the adapter's ranks)."""
    halves, _, tensor_names = group_lora_tensors(old.name, tensors, num_layers)
    for key, pair in halves.items():
        if key not in old.weights:
            tname = tensor_names[(key, next(iter(pair)))]
            raise ValueError(f"LoRA adapter {old.name!r} has no weights for layer {key[0]} "
                             f"{key[1]} (tensor {tname!r}); an update changes the adapter's own "
                             f"weights only")
        have = dict(zip("AB", old.weights[key]))
        for half, t in pair.items():
            if tuple(t.shape) != tuple(have[half].shape):
                raise ValueError(f"LoRA adapter {old.name!r}: layer {key[0]} {key[1]} lora_"
                                 f"{half} is {list(have[half].shape)}, the update sends "
                                 f"{list(t.shape)} (tensor {tensor_names[(key, half)]!r})")
    return halves


def updated_adapter(old: LoraAdapter, tensors, num_layers: int) -> LoraAdapter:
    """``old`` with the A or B matrices of PEFT-named ``tensors`` replaced (the rest, ranks
    and scalings kept); ValueError as :func:`checked_update`."""
    weights = dict(old.weights)
    for key, pair in checked_update(old, tensors, num_layers).items():
        new = dict(zip("AB", weights[key]))
        for half, t in pair.items():
            new[half] = t.detach().float().cpu().clone()
        weights[key] = (new["A"], new["B"])
    return LoraAdapter(old.name, old.path, old.rank, weights, dict(old.scalings))


def read_peft_adapter(name: str, path: str, num_layers: int) -> LoraAdapter:
    """Read a PEFT LoRA folder. ValueError naming the adapter for a missing file, an
    unsupported config or a tensor outside the served projections."""
    from safetensors.torch import load_file

    cfg_path = os.path.join(path, "adapter_config.json")
    weights_path = os.path.join(path, "adapter_model.safetensors")
    for p in (cfg_path, weights_path):
        if not os.path.isfile(p):
            raise ValueError(f"LoRA adapter {name!r}: {p} not found (a PEFT folder has "
                             "adapter_config.json and adapter_model.safetensors)")
    with open(cfg_path) as f:
        cfg = json.load(f)
    _check_config(cfg, name)
    halves, full_names, _ = group_lora_tensors(name, load_file(weights_path).items(),
                                               num_layers)
    weights, scalings, rank = {}, {}, 0
    alpha0, r0 = cfg.get("lora_alpha", cfg.get("r", 8)), cfg.get("r", 8)
    for key, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: layer {key[0]} {key[1]} lacks lora_"
                             f"{'B' if 'A' in pair else 'A'}")
        a, b = pair["A"].float(), pair["B"].float()
        r = a.shape[0]
        if b.shape[1] != r:
            raise ValueError(f"LoRA adapter {name!r}: layer {key[0]} {key[1]}: lora_A has rank "
                             f"{r}, lora_B {b.shape[1]}")
        alpha = _pattern_value(cfg.get("alpha_pattern"), full_names[key], alpha0)
        r_cfg = _pattern_value(cfg.get("rank_pattern"), full_names[key], r0)
        if r_cfg != r:
            raise ValueError(f"LoRA adapter {name!r}: layer {key[0]} {key[1]} has rank {r}, "
                             f"its config says {r_cfg}")
        scalings[key] = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        weights[key] = (a, b)
        rank = max(rank, r)
    if not weights:
        raise ValueError(f"LoRA adapter {name!r}: {weights_path} holds no LoRA weights")
    return LoraAdapter(name, path, rank, weights, scalings)
