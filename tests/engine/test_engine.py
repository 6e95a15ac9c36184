"""The embedded engine through the real `openai` SDK, on the tiny random model.

Exactness is checked against a plain transformers forward over prompt +
completion, the way the trainer recomputes logprobs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning.engine import Engine, SamplingParams
from lightning.engine.server import RequestError, RunningServer, parse_common
from lightning.model_cache import tiny_model_dir

MESSAGES = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir()


@pytest.fixture(scope="module")
def server(model_dir: Path):
    engine = Engine(model_dir, max_batch=8).start()
    with RunningServer(engine) as running:
        yield running
    engine.close()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


def reference_logprobs(model_dir: Path, prompt: list[int], completion: list[int]) -> list[float]:
    """The trainer's recomputation: log_softmax of one plain forward over prompt + completion."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()  # [L, V]
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(completion)]


def template_ids(tokenizer, messages) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_health_and_models(server: RunningServer, client: openai.OpenAI) -> None:
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["weight_version"] == 0
    models = client.models.list()
    assert [m.id for m in models.data] == [server.engine.model_name]


def test_tokenize_counts_the_chat_prompt(server: RunningServer, tokenizer) -> None:
    """vLLM's ``POST /tokenize`` (at the server root): the ids ``/v1/chat/completions``
    would prompt with, generation prompt included; or a plain prompt's ids."""
    r = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()
    want = template_ids(tokenizer, MESSAGES)
    assert r == {"count": len(want), "max_model_len": server.engine.max_model_len, "tokens": want}
    bare = httpx.post(
        server.url + "/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}
    ).json()
    assert bare["count"] < r["count"] and r["tokens"][: bare["count"]] == bare["tokens"]
    text = httpx.post(server.url + "/tokenize", json={"prompt": "Hello"}).json()
    assert text["tokens"] == server.engine.text_prompt_ids("Hello")
    bad = httpx.post(server.url + "/tokenize", json={"model": "nope", "prompt": "x"})
    assert bad.status_code == 404


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_ids_and_logprobs_match_trainer(
    client: openai.OpenAI, tokenizer, model_dir: Path, temperature: float
) -> None:
    resp = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=MESSAGES,
        max_tokens=12,
        temperature=temperature,
        seed=7,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True},
    )
    extra = resp.model_extra or {}
    prompt = extra["prompt_token_ids"]
    assert prompt == template_ids(tokenizer, MESSAGES)
    assert extra["weight_version"] == 0
    choice = resp.choices[0]
    ids = choice.model_extra["token_ids"]
    assert len(ids) == 12 == resp.usage.completion_tokens
    assert choice.finish_reason == "length"
    assert tokenizer.decode(ids, skip_special_tokens=True) == choice.message.content
    content = choice.logprobs.content
    assert len(content) == len(ids)
    want = reference_logprobs(model_dir, prompt, ids)
    got = [c.logprob for c in content]
    assert max(abs(a - b) for a, b in zip(want, got, strict=True)) < 1e-4
    for c, tid in zip(content, ids, strict=True):
        assert len(c.top_logprobs) == 3
        assert c.top_logprobs[0].logprob >= c.logprob - 1e-6
        assert bytes(c.bytes) == tokenizer.convert_tokens_to_string(
            tokenizer.convert_ids_to_tokens([tid])
        ).encode() or "\ufffd" in tokenizer.decode([tid])
    if temperature == 0.0:
        # Greedy picks the argmax, so it is its own top alternative.
        assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)


def test_completions_prompt_ids_and_logprobs(
    client: openai.OpenAI, tokenizer, model_dir: Path
) -> None:
    prompt = tokenizer("The capital of France is")["input_ids"]
    resp = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=prompt,
        max_tokens=8,
        temperature=1.0,
        seed=3,
        logprobs=2,
        extra_body={"return_token_ids": True},
    )
    choice = resp.choices[0]
    extra = choice.model_extra
    assert extra["prompt_token_ids"] == prompt
    ids = extra["token_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == choice.text
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.text_offset) == len(ids)
    want = reference_logprobs(model_dir, prompt, ids)
    assert max(abs(a - b) for a, b in zip(want, lp.token_logprobs, strict=True)) < 1e-4
    assert all(len(t) >= 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # Text prompts are tokenized like vLLM does (add_special_tokens=True).
    text = client.completions.create(
        model=resp.model,
        prompt="The capital of France is",
        max_tokens=2,
        extra_body={"return_token_ids": True},
    )
    assert text.choices[0].model_extra["prompt_token_ids"] == prompt


def test_chat_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    kwargs = dict(
        model="tiny-llama-h64-l2-a4-s0",
        messages=MESSAGES,
        max_tokens=10,
        temperature=1.0,
        seed=11,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    first = chunks[0]
    assert first.choices[0].delta.role == "assistant"
    assert first.model_extra["prompt_token_ids"] == whole.model_extra["prompt_token_ids"]
    body = [c for c in chunks if c.choices]
    ids = [t for c in body for t in (c.choices[0].model_extra.get("token_ids") or [])]
    text = "".join(c.choices[0].delta.content or "" for c in body)
    lps = [e.logprob for c in body if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert ids == whole.choices[0].model_extra["token_ids"]
    assert text == whole.choices[0].message.content
    assert lps == pytest.approx([e.logprob for e in whole.choices[0].logprobs.content], abs=1e-6)
    assert body[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids) == 10
    assert all(c.model_extra["weight_version"] == 0 for c in chunks)


def test_completion_streaming(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model="tiny-llama-h64-l2-a4-s0",
        prompt=[1, 2, 3, 4],
        max_tokens=6,
        seed=5,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
    )
    chunks = list(stream)
    body = [c for c in chunks if c.choices]
    assert body[0].choices[0].model_extra["prompt_token_ids"] == [1, 2, 3, 4]
    assert all("prompt_token_ids" not in c.choices[0].model_extra for c in body[1:])
    ids = [t for c in body for t in c.choices[0].model_extra["token_ids"]]
    assert len(ids) == 6 and body[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.prompt_tokens == 4 and chunks[-1].usage.completion_tokens == 6


def test_n_seed_and_stop(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny-llama-h64-l2-a4-s0", messages=MESSAGES, max_tokens=16, seed=42)
    a = client.chat.completions.create(**kwargs, n=3)
    b = client.chat.completions.create(**kwargs, n=3)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in b.choices]  # seeded: reproducible
    assert len(set(texts)) > 1  # choices of one request differ
    assert a.usage.completion_tokens == 48
    # Stop at a string the seeded run is known to produce: text is cut before it.
    text = texts[0]
    stop = text[6:9]
    cut = client.chat.completions.create(
        **kwargs, stop=[stop], extra_body={"return_token_ids": True}
    )
    choice = cut.choices[0]
    assert choice.message.content == text[: text.index(stop)]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop


def test_errors_are_openai_shaped(server: RunningServer, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="nope", messages=MESSAGES)
    assert nf.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="", messages=MESSAGES, temperature=-1)
    assert "temperature" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model="", prompt=[5] * 2100, max_tokens=4)
    assert long.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="", messages=MESSAGES, top_p=0)
    r = httpx.post(
        server.url + "/v1/chat/completions",
        content=b"{not json",
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 400 and set(r.json()["error"]) >= {"message", "type", "code"}


@pytest.mark.parametrize(
    ("body", "chat", "param"),
    [
        ({"frequency_penalty": 0.5}, True, "frequency_penalty"),
        ({"repetition_penalty": 1.2}, False, "repetition_penalty"),
        ({"logit_bias": {"5": 1}}, True, "logit_bias"),
        ({"best_of": 2}, False, "best_of"),
        ({"echo": True}, False, "echo"),
        ({"suffix": "x"}, False, "suffix"),
        ({"stop": 5}, True, "stop"),
        ({"stop": ["a", 1]}, False, "stop"),
        ({"top_logprobs": 2}, True, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 99}, True, "top_logprobs"),
        ({"logprobs": 99}, False, "logprobs"),
    ],
)
def test_request_options_the_engine_cannot_honour_are_refused(
    body: dict[str, object], chat: bool, param: str
) -> None:
    # A 400 that names the option, never a silently different sampler.
    engine = SimpleNamespace(model_name="m", model_path="/m")
    with pytest.raises(RequestError) as err:
        parse_common(body, chat=chat, default_max=8, engine=engine)  # type: ignore[arg-type]
    assert err.value.status == 400 and err.value.param == param


def test_request_options_read_into_sampling_params() -> None:
    engine = SimpleNamespace(model_name="m", model_path="/m")
    body = {"stop": ["a", "b"], "logprobs": True, "top_logprobs": 2, "n": 2, "seed": 7}
    chat = parse_common(body, chat=True, default_max=8, engine=engine)  # type: ignore[arg-type]
    assert [p.stop for p in chat.params] == [("a", "b")] * 2
    assert [(p.logprobs, p.seed, p.max_tokens) for p in chat.params] == [(2, 7, 8), (2, 8, 8)]
    plain = parse_common({"stop": "z", "logprobs": 3}, chat=False, default_max=None, engine=engine)  # type: ignore[arg-type]
    assert (plain.params[0].stop, plain.params[0].logprobs) == (("z",), 3)
    assert parse_common({}, chat=True, default_max=None, engine=engine).params[0].logprobs is None  # type: ignore[arg-type]


def test_batched_equals_unbatched(model_dir: Path) -> None:
    with Engine(model_dir, max_batch=8) as engine:
        prompts = [
            engine.chat_prompt_ids([{"role": "user", "content": "x" * i}]) for i in range(1, 7)
        ]
        for params in (
            SamplingParams(max_tokens=12, temperature=0.0),
            SamplingParams(max_tokens=12, temperature=1.0, seed=9),
        ):
            one = [engine.generate(p, params) for p in prompts]
            many = engine.generate_many(prompts, params)
            for a, b in zip(one, many, strict=True):
                assert a.token_ids == b.token_ids
                assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
        # Continuous batching: sequences of different lengths join and leave mid-batch.
        mixed = [SamplingParams(max_tokens=3 + 4 * i, temperature=0.0) for i in range(len(prompts))]
        alone = [engine.generate(p, s) for p, s in zip(prompts, mixed, strict=True)]
        done = []
        import threading

        def run(i: int) -> None:
            done.append((i, engine.generate(prompts[i], mixed[i])))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
            time.sleep(0.01)
        for t in threads:
            t.join()
        for i, r in done:
            assert r.token_ids == alone[i].token_ids


def test_weight_reload(model_dir: Path, tmp_path: Path, tokenizer) -> None:
    engine = Engine(model_dir, max_batch=4)
    with RunningServer(engine) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0)
        kwargs = dict(
            model="",
            messages=MESSAGES,
            max_tokens=8,
            temperature=1.0,
            seed=1,
            logprobs=True,
            extra_body={"return_token_ids": True},
        )
        before = client.chat.completions.create(**kwargs)
        new = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        torch.manual_seed(0)
        with torch.no_grad():
            for p in new.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        out = tmp_path / "step1"
        new.save_pretrained(out)
        r = httpx.post(running.url + "/admin/load_weights", json={"path": str(out), "version": 5})
        assert r.status_code == 200 and r.json()["weight_version"] == 5
        assert httpx.get(running.url + "/health").json()["weight_version"] == 5
        after = client.chat.completions.create(**kwargs)
        assert after.model_extra["weight_version"] == 5
        ids = after.choices[0].model_extra["token_ids"]
        got = [c.logprob for c in after.choices[0].logprobs.content]
        assert got != [c.logprob for c in before.choices[0].logprobs.content]
        want = reference_logprobs(out, after.model_extra["prompt_token_ids"], ids)
        assert max(abs(a - b) for a, b in zip(want, got, strict=True)) < 1e-4
        bad = httpx.post(running.url + "/admin/load_weights", json={"path": str(tmp_path / "none")})
        assert bad.status_code == 400 and "error" in bad.json()
    engine.close()


def test_serve_cli(model_dir: Path) -> None:
    # Without LIGHTNING_ENGINE_KEY (an in-process demo test may have set it): the
    # engine then makes a random key and logs it.
    env = {k: v for k, v in os.environ.items() if k != "LIGHTNING_ENGINE_KEY"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "lightning.cli", "serve", str(model_dir), "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        url = None
        deadline = time.monotonic() + 120
        assert proc.stderr is not None
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            if " on http://" in line:
                url = line.split(" on ")[1].split()[0]
                key = line.split(" with key ")[1].split()[0]
        assert url, "the server never logged its URL"
        for _ in range(200):
            try:
                health = httpx.get(url + "/health").json()
                break
            except httpx.TransportError:
                time.sleep(0.05)
        assert health["status"] == "ok" and health["weight_version"] == 0
        body = {"prompt": [1, 2], "max_tokens": 2, "return_token_ids": True}
        # A random key per start (issue 39): nothing but /health answers without it.
        assert len(key) >= 16
        assert httpx.post(url + "/v1/completions", json=body).status_code == 401
        assert httpx.post(url + "/admin/load_weights", json={"path": "/x"}).status_code == 401
        auth = {"Authorization": f"bearer {key}"}  # the scheme in any case
        r = httpx.post(url + "/v1/completions", json=body, headers=auth)
        assert len(json.loads(r.text)["choices"][0]["token_ids"]) == 2
        # A cross-site text/plain POST and a DNS-rebinding Host: refused before the route.
        plain = httpx.post(
            url + "/admin/load_weights",
            content=json.dumps({"path": "/x"}),
            headers={**auth, "Content-Type": "text/plain"},
        )
        assert plain.status_code == 415, plain.text
        rebound = httpx.post(
            url + "/v1/completions", json=body, headers={**auth, "Host": "attacker.example"}
        )
        assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "host_not_allowed"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stderr is not None:
            proc.stderr.close()


def test_reload_lets_in_flight_finish_on_old_weights(model_dir: Path, tmp_path: Path) -> None:
    new = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in new.parameters():
            p.mul_(1.5)
    new.save_pretrained(tmp_path / "w")
    with Engine(model_dir, max_batch=4) as engine:
        prompt = engine.chat_prompt_ids(MESSAGES)
        long = SamplingParams(max_tokens=200, seed=0, ignore_eos=True)
        box: list = []
        import threading

        worker = threading.Thread(target=lambda: box.append(engine.generate(prompt, long)))
        worker.start()
        while engine.status()["running"] == 0 and not box:
            time.sleep(0.005)
        assert engine.load_weights(tmp_path / "w", 3) == 3
        # load_weights returned only after the in-flight sequence finished, on version 0.
        assert box and box[0].weight_version == 0 and len(box[0].token_ids) == 200
        worker.join()
        old = reference_logprobs(model_dir, prompt, box[0].token_ids)
        assert max(abs(a - b) for a, b in zip(old, box[0].logprobs, strict=True)) < 1e-4
        after = engine.generate(prompt, SamplingParams(max_tokens=4, seed=0))
        assert after.weight_version == 3 and engine.status()["weight_version"] == 3


PARENT = """
import sys, time
from pathlib import Path
from lightning.run.loop import EmbeddedEngine
engine = EmbeddedEngine(
    Path(sys.argv[1]), host="127.0.0.1", port=0, max_batch=2, dtype="float32",
    threads=1, log_path=Path(sys.argv[2]),
)
engine.wait_ready(120)
print(engine.proc.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


def test_the_embedded_engine_exits_when_its_parent_is_killed(
    model_dir: Path, tmp_path: Path
) -> None:
    """`lightning train`/`demo` killed with SIGKILL (no cleanup runs) leaves no engine
    behind: the child notices its parent is gone and stops within seconds."""
    with subprocess.Popen(
        [sys.executable, "-c", PARENT, str(model_dir), str(tmp_path / "engine.log")],
        stdout=subprocess.PIPE,
        text=True,
    ) as parent:
        assert parent.stdout is not None
        try:
            child = int(parent.stdout.readline())
            assert _alive(child)
        finally:
            parent.kill()
    deadline = time.monotonic() + 30
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.2)
    log = (tmp_path / "engine.log").read_text()
    assert not _alive(child), log[-2000:]
    assert "parent process" in log


def test_serve_refuses_a_context_longer_than_the_model(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--max-model-len` past the model's positions is refused at start, naming
    the model's limit (positions past the trained range are not context)."""
    import json

    from lightning.engine.server import serve

    positions = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    assert serve([str(model_dir), "--max-model-len", str(positions * 2), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert f"max_model_len {positions * 2} exceeds this model's {positions} positions" in err
    assert f"--max-model-len {positions} or less" in err
