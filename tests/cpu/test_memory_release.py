"""release_memory_occupation / resume_memory_occupation (tags kv_cache, weights), in-process.

The memory tests read the process's resident set: what a release frees must leave
it and what a resume takes must come back, at least 80% of the tensors' bytes.
glibc hands chunks of 32 MiB and more straight back to the kernel (mmap), so the
model here is sized with weights of ~120 MiB and KV buffers of ~50 MiB per layer;
its greedy output must not change across a release and resume.
"""

import contextlib
import gc
import itertools
import os
import time

import pytest
import torch
from engine_helpers import GREEDY, in_thread, wait_until

from radixray import Engine

PARAMS = {"max_new_tokens": 16, **GREEDY}
BIG_TOKENS = 50_000  # x 4096 bytes per token: 195 MiB of KV, 51 MiB per buffer


def resident() -> dict[str, int]:
    """The process's resident memory by kind (``RssAnon``, ``RssFile``, ``RssShmem``), in bytes."""
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)
                if k in ("RssAnon", "RssFile", "RssShmem")}


def rss() -> int:
    """The process's resident anonymous memory, in bytes: what the tensors' storages are.
    File and shared pages are left out: mapped libraries, model files and Ray's object store
    (mapped by earlier tests that ran Ray in this process) come and go with the page cache
    and with their owners, not with a release."""
    return resident()["RssAnon"]


@contextlib.contextmanager
def no_gc():
    """Python's cyclic garbage collected first and kept from running inside the block: an
    earlier test's objects freed mid-measurement (an engine in a reference cycle, its pool
    and weights) would move the resident set by their size."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@contextlib.contextmanager
def paused(engine: Engine, mode: str):
    """Generation paused for the block; whatever the block left released is resumed and
    generation continues afterwards, also when it fails, so a module-scoped engine serves
    the next test (a paused engine would leave its generate calls waiting for good)."""
    engine.pause_generation(mode)
    try:
        yield
    finally:
        if engine.memory.released:
            engine.resume_memory_occupation(None)
        if engine.call_in_loop(lambda s: s.paused) is not None:
            engine.continue_generation()


def weight_bytes(engine: Engine) -> int:
    """Bytes under the model's parameters and buffers, each storage once (the parameters
    are views into one packed buffer; tied or transposed tensors share storage)."""
    model = engine.runner.model
    storages = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    assert sum(storages.values()) >= sum(p.numel() * p.element_size() for p in model.parameters())
    return sum(storages.values())


def kv_bytes(engine: Engine) -> int:
    """Slot 0 (padding) plus every usable slot, at the model's bytes per token."""
    return (engine.runner.max_total_tokens + 1) * engine.runner.bytes_per_token


def touch_kv_pool(engine: Engine) -> None:
    """Make the whole KV pool resident, as a long-serving engine's is (a fresh pool is
    allocated untouched). Only before any request: zeros would overwrite cached KV."""
    def touch(s):
        for buf in s.runner.kv_pool.k_buffers + s.runner.kv_pool.v_buffers:
            buf.zero_()
    engine.call_in_loop(touch)


def greedy(engine: Engine, prompt: str) -> list[int]:
    engine.flush_cache()  # the same path (no prefix hit) on every call
    return engine.generate(prompt, PARAMS)["output_ids"]


def build_big_llama(folder: str) -> str:
    """A 2-layer Llama with hidden size 1024 (~120 MiB of fp32 weights), random weights
    written straight to safetensors (much faster than a Hugging Face init)."""
    from model_fixtures import byte_bpe_tokenizer, tiny_config
    from safetensors.torch import save_file

    tok = byte_bpe_tokenizer()
    cfg = tiny_config("llama", len(tok))
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = 1024, 4096, 2
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 8, 2, 128
    cfg.architectures = ["LlamaForCausalLM"]
    h, inter, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "lm_head.weight": (cfg.vocab_size, h),
              "model.norm.weight": (h,)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
    gen = torch.Generator().manual_seed(0)
    tensors = {name: torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * 0.03
               for name, shape in shapes.items()}
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    folder = build_big_llama(str(tmp_path_factory.mktemp("big-llama")))
    with Engine(model=folder, dtype="float32", max_total_tokens=BIG_TOKENS,
                check_kv_conservation=True) as engine:
        touch_kv_pool(engine)
        yield engine
        engine.check_kv_conservation()


@pytest.fixture
def tiny(tiny_llama_dir):
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=4096,
                check_kv_conservation=True) as engine:
        yield engine
        engine.check_kv_conservation()


@pytest.mark.parametrize("tags", [["kv_cache"], ["weights"], None], ids=["kv_cache", "weights", "all"])
def test_release_frees_the_memory_and_resume_restores_it_with_the_same_output(big, tags):
    # cuda_graph frees nothing on the CPU (no decode graphs there)
    expected = {"kv_cache": kv_bytes(big), "weights": weight_bytes(big), "cuda_graph": 0}
    assert expected["weights"] > 100 * 2**20 and expected["kv_cache"] > 150 * 2**20
    names = tags or ["kv_cache", "weights", "cuda_graph"]
    want_bytes = sum(expected[t] for t in names)
    want = greedy(big, "release me")
    with paused(big, "retract"):
        with no_gc():
            before = rss()
            out = big.release_memory_occupation(tags)
            freed = before - rss()
        assert out["tags"] == names and out["released"] == sorted(names)
        assert out["bytes"] == want_bytes
        assert freed >= 0.8 * want_bytes, f"RSS fell {freed / 2**20:.1f} MiB of {want_bytes / 2**20:.1f} (now {resident()})"
        kv = big.check_kv_conservation()
        if "kv_cache" in names:  # flushed: every slot free, nothing cached
            assert kv["free"] == kv["pool"] and kv["cached"] == 0

        with no_gc():
            low = rss()
            back = big.resume_memory_occupation(tags)
            restored = rss() - low
        assert back["tags"] == names and back["released"] == [] and back["bytes"] == want_bytes
        assert restored >= 0.8 * want_bytes, f"RSS rose {restored / 2**20:.1f} MiB of {want_bytes / 2**20:.1f} (now {resident()})"
        print(f"\n{names}: {want_bytes / 2**20:.0f} MiB, RSS -{freed / 2**20:.0f} / +{restored / 2**20:.0f} MiB, "
              f"release {out['seconds']:.3f} s, resume {back['seconds']:.3f} s")

        assert big.continue_generation() is True
    assert greedy(big, "release me") == want
    big.check_kv_conservation()


def test_each_refusal_changes_nothing_and_the_engine_serves_afterwards(tiny):
    want = greedy(tiny, "refusals")
    with pytest.raises(ValueError, match="needs generation paused: call pause_generation first"):
        tiny.release_memory_occupation(["weights"])
    assert tiny.memory.released == set()

    # in_place keeps running requests' KV: kv_cache cannot go, weights can (test below)
    t, box = in_thread(tiny.generate, prompt="held in place",
                       sampling_params={**PARAMS, "max_new_tokens": 400})
    wait_until(tiny, lambda s: any(r.output_ids for r in s.queues.running))
    assert tiny.pause_generation("in_place") == 1
    kv_before = tiny.check_kv_conservation()
    for tags in (["kv_cache"], None):
        with pytest.raises(ValueError, match=r"hold KV .*mode='retract'.*mode='abort'"):
            tiny.release_memory_occupation(tags)
    assert tiny.check_kv_conservation() == kv_before and tiny.memory.released == set()

    tiny.pause_generation("retract")  # now nobody holds KV
    with pytest.raises(ValueError, match=r"unknown tag 'gpu'; the tags are \['kv_cache', 'weights', 'cuda_graph'\]"):
        tiny.release_memory_occupation(["kv_cache", "gpu"])
    with pytest.raises(ValueError, match="resume_memory_occupation: 'weights' is not released"):
        tiny.resume_memory_occupation(["weights"])
    assert tiny.memory.released == set()

    assert tiny.release_memory_occupation("kv_cache")["released"] == ["kv_cache"]
    for tags in (["kv_cache"], None):  # None means both: kv_cache is already gone
        with pytest.raises(ValueError, match="'kv_cache' is already released"):
            tiny.release_memory_occupation(tags)
    with pytest.raises(ValueError, match="'weights' is not released"):
        tiny.resume_memory_occupation(["kv_cache", "weights"])
    with pytest.raises(ValueError, match=r"resume_memory_occupation\(\['kv_cache'\]\) first"):
        tiny.continue_generation()
    assert tiny.memory.released == {"kv_cache"} and tiny.call_in_loop(lambda s: s.paused) == "retract"
    kv = tiny.check_kv_conservation()
    assert kv["free"] == kv["pool"] and kv["cached"] == 0

    back = tiny.resume_memory_occupation(None)  # None: every released tag
    assert back["tags"] == ["kv_cache"] and back["bytes"] == kv_bytes(tiny) and back["released"] == []
    assert tiny.resume_memory_occupation(None)["tags"] == []  # nothing released: nothing to do
    assert tiny.continue_generation() is True
    t.join(60)
    assert len(box["out"]["output_ids"]) == 400  # the retracted request went on
    assert greedy(tiny, "refusals") == want


def test_weights_go_and_come_back_under_an_in_place_pause(tiny):
    """Requests paused in place keep their KV while the weights are away; they go on
    afterwards with the output of an uninterrupted run."""
    params = {**PARAMS, "max_new_tokens": 60}
    want = tiny.generate("in place", params)["output_ids"]
    t, box = in_thread(tiny.generate, prompt="in place", sampling_params=params)
    wait_until(tiny, lambda s: any(len(r.output_ids) > 5 for r in s.queues.running))
    assert tiny.pause_generation("in_place") == 1
    nbytes = weight_bytes(tiny)
    assert tiny.release_memory_occupation(["weights"])["bytes"] == nbytes
    assert tiny.resume_memory_occupation(["weights"])["released"] == []
    tiny.continue_generation()
    t.join(60)
    assert box["out"]["output_ids"] == want


def test_int8_weights_and_their_packed_copies_come_back(tiny_llama_dir):
    """w8a8_int8 keeps its weights in module buffers (int8 codes, packed VNNI copies,
    scales), the int8 lm_head too: all of them are released and restored."""
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=4096,
                quantization="w8a8_int8", quantize_lm_head=True) as engine:
        model = engine.runner.model
        buffers = {t.untyped_storage().data_ptr() for t in model.buffers()}
        assert model.lm_head_int8 is not None and len(buffers) > 10
        want = greedy(engine, "int8 weights")
        engine.pause_generation("abort")
        nbytes = weight_bytes(engine)
        assert engine.release_memory_occupation(["weights"])["bytes"] == nbytes
        assert all(t.untyped_storage().nbytes() == 0 for t in model.buffers())
        assert engine.resume_memory_occupation()["bytes"] == nbytes
        engine.continue_generation()
        assert greedy(engine, "int8 weights") == want


@pytest.mark.slow  # out of the default run's 15-minute budget: make test-slow
def test_default_model_release_and_resume():
    """SmolLM2-135M (fp32, ~520 MiB of weights) with a small pool: both tags at once."""
    t0 = time.perf_counter()
    with Engine(model="default", dtype="float32", max_total_tokens=4096,
                check_kv_conservation=True) as engine:
        touch_kv_pool(engine)
        load_s = time.perf_counter() - t0
        want_bytes = weight_bytes(engine) + kv_bytes(engine)
        want = greedy(engine, "The capital of France is")
        engine.pause_generation("abort")
        with no_gc():
            before = rss()
            out = engine.release_memory_occupation()
            low = rss()
            back = engine.resume_memory_occupation()
            high = rss()
        assert out["bytes"] == back["bytes"] == want_bytes
        assert before - low >= 0.8 * want_bytes and high - low >= 0.8 * want_bytes
        print(f"\nSmolLM2-135M: load {load_s:.1f} s, {want_bytes / 2**20:.0f} MiB, RSS "
              f"-{(before - low) / 2**20:.0f} / +{(high - low) / 2**20:.0f} MiB, "
              f"release {out['seconds']:.2f} s, resume {back['seconds']:.2f} s")
        engine.continue_generation()
        assert greedy(engine, "The capital of France is") == want
        engine.check_kv_conservation()
