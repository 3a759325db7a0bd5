"""Perturbed Hugging Face models and the greedy comparison the weight-update tests share."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
from model_fixtures import assert_greedy_equal, hf_greedy
from serving_helpers import free_port

GREEDY_N = {"temperature": 0.0, "ignore_eos": True}


def perturb(hf_model, seed: int, scale: float = 0.3) -> dict[str, torch.Tensor]:
    """Change every parameter of ``hf_model`` in place (noise proportional to its spread, plus
    an offset so constant tensors such as norm weights change too); returns them by name."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in hf_model.named_parameters():
            spread = float(p.float().std()) if p.numel() > 1 else 0.0
            noise = torch.randn(p.shape, generator=gen) * (spread or 0.05) * scale
            p.add_(noise.to(p.device, p.dtype) + 0.01)
    return {n: p.detach() for n, p in hf_model.named_parameters()}


def assert_matches_hf(engine, hf_model, prompts: list[list[int]], new_tokens: int, label: str,
                      version: int | None = None) -> list[dict]:
    """Greedy output of ``engine`` equals ``hf_model``'s for each prompt (near-ties excepted);
    each result reports ``version`` when given."""
    outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY_N,
                                                               "max_new_tokens": new_tokens})
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        ref, gaps = hf_greedy(hf_model, prompt, new_tokens)
        assert_greedy_equal(out["output_ids"], ref, gaps, f"{label} prompt {i}")
        if version is not None:
            assert out["meta_info"]["weight_version"] == version
    return outs


TRAINER = textwrap.dedent("""
    import sys, torch
    from safetensors.torch import load_file
    from radixray.engine.weights.sync import WeightBroadcaster
    port, path = int(sys.argv[1]), sys.argv[2]
    tensors = load_file(path)
    sender = WeightBroadcaster("127.0.0.1", port, world_size=2, group_name="g", backend="gloo",
                               timeout_s=120)
    named = sorted(tensors.items())
    print(sender.send(named))
    sender.close()
""")


def spawn_trainer(named: dict, folder) -> tuple[subprocess.Popen, int]:
    """A trainer process (rank 0 on a free port) that will broadcast ``named`` in name order."""
    from safetensors.torch import save_file
    path = folder / "w.safetensors"
    save_file({k: v.contiguous() for k, v in named.items()}, str(path))
    port = free_port()
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(port), str(path)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return trainer, port
