"""The naive baseline server: OpenAI API over one HF generate per request, one at a time.

Every answer is compared with Hugging Face ``generate`` on the same tiny Llama.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest


@pytest.fixture(scope="module")
def naive(tiny_llama_dir):
    """(NaiveServer, base url) with uvicorn serving in a background thread on a free port."""
    from serving_helpers import uvicorn_in_thread

    from radixray.bench.naive_server import NaiveServer, create_app
    server = NaiveServer.load(tiny_llama_dir, model_id="tiny")
    with uvicorn_in_thread(create_app(server)) as url:
        yield server, url


@pytest.fixture(scope="module")
def client(naive):
    import openai
    return openai.OpenAI(base_url=f"{naive[1]}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_llama_dir)


def hf_greedy(hf, ids: list[int], max_new: int, ignore_eos: bool = False) -> tuple[str, int]:
    """Reference (text, number of new tokens) from plain HF greedy generate."""
    import torch
    model, tok = hf
    x = torch.tensor([ids])
    extra = {"min_new_tokens": max_new} if ignore_eos else {}
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                             do_sample=False, pad_token_id=0, **extra)
    new = out[0, len(ids):].tolist()
    return tok.decode(new, skip_special_tokens=True), len(new)


PROMPT = "Hello world, this is"


def test_models_and_health(naive, client):
    import httpx
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{naive[1]}/health").json() == {"status": "ok"}


def test_greedy_completion_matches_hf(client, hf):
    ids = hf[1](PROMPT).input_ids
    want, n = hf_greedy(hf, ids, 24)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == want
    assert r.choices[0].finish_reason == ("length" if n == 24 else "stop")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), n)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=24, temperature=0)
    assert by_ids.choices[0].text == want


def test_stream_concatenates_to_the_same_text(client, hf):
    ids = hf[1](PROMPT).input_ids
    want, n = hf_greedy(hf, ids, 32, ignore_eos=True)
    chunks = list(client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=32, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert len(chunks) > 3  # really streamed, not one blob
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n == 32
    assert chunks[-1].usage.prompt_tokens == len(ids)


def test_ignore_eos_gives_exactly_max_tokens(client):
    r = client.completions.create(model="tiny", prompt="STOP", max_tokens=57, temperature=0.8,
                                  seed=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 57 and r.choices[0].finish_reason == "length"


def test_seed_makes_sampling_repeatable(client):
    ask = dict(model="tiny", prompt=PROMPT, max_tokens=20, temperature=1.0, top_p=0.9, seed=7,
               extra_body={"ignore_eos": True, "top_k": 50})
    assert client.completions.create(**ask).choices[0].text == client.completions.create(**ask).choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_truncates_and_stops(client, hf, stream):
    ids = hf[1](PROMPT).input_ids
    full, _ = hf_greedy(hf, ids, 40, ignore_eos=True)
    stop = full[len(full) // 2:len(full) // 2 + 2]
    ask = dict(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop],
               extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish, used = chunks[-2].choices[0].finish_reason, chunks[-1].usage.completion_tokens
    else:
        r = client.completions.create(**ask)
        text, finish, used = r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
    assert text == full[:full.find(stop)] and finish == "stop"
    assert used < 40  # generation stopped at the stop string, not at max_tokens


def test_chat_matches_hf_with_template(client, hf):
    messages = [{"role": "user", "content": "Hello world"}]
    text = hf[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want, n = hf_greedy(hf, hf[1](text, add_special_tokens=False).input_ids, 20)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want and r.usage.completion_tokens == n
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=20,
                                                 temperature=0, stream=True))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_bad_requests_get_400_and_the_server_keeps_serving(naive, client):
    import httpx
    import openai
    r = httpx.post(f"{naive[1]}/v1/completions", json={"model": "tiny", "max_tokens": 4})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] == "prompt"
    r = httpx.post(f"{naive[1]}/v1/chat/completions", json={"model": "tiny"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0)
    assert e.value.status_code == 400 and e.value.body["param"] == "max_tokens"
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3).usage.prompt_tokens > 0


def test_concurrent_requests_are_served_one_at_a_time(naive, client, hf, monkeypatch):
    server = naive[0]
    active, peak, real = [0], [0], server.model.generate
    guard = threading.Lock()

    def tracked(*args, **kwargs):
        with guard:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            return real(*args, **kwargs)
        finally:
            with guard:
                active[0] -= 1

    monkeypatch.setattr(server.model, "generate", tracked)
    want, _ = hf_greedy(hf, hf[1](PROMPT).input_ids, 48, ignore_eos=True)
    ask = dict(model="tiny", prompt=PROMPT, max_tokens=48, temperature=0, extra_body={"ignore_eos": True})
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: client.completions.create(**ask), range(2)))
    assert [r.choices[0].text for r in results] == [want, want]
    assert peak[0] == 1


def test_client_disconnect_mid_stream_stops_generation(naive, client):
    import httpx
    server, url = naive
    before = server.cancelled
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data: "))
    # The next request queues on the lock, which the cancelled generation releases.
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).usage.completion_tokens >= 1
    assert server.cancelled == before + 1
