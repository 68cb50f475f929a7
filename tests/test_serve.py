"""`marinrl serve CHECKPOINT` (marinrl/serve.py): a Hugging Face checkpoint and a Levanter run folder the tests
write, each served by the real command in a process of its own, queried with the `openai` client and with
verifiers 0.4's own `TrainClient` from the verifiers virtualenv, then stopped by SIGINT or SIGTERM with no port
left behind; bad input is one line naming the path or the address, before any weights load.
"""

from __future__ import annotations

import os
import pathlib
import queue
import re
import signal
import socket
import subprocess
import sys
import threading

import httpx
import numpy as np
import openai
import pytest
from levanter.models.llama import LlamaConfig
from verifiers_support import run_verifiers_client, verifiers_interpreter

import marinrl
from marinrl.cli import main as cli
from marinrl.config.model import ModelConfig
from marinrl.inference.context import chat_prompt_tokens
from marinrl.models.hf_checkpoints import save_hf_checkpoint
from marinrl.models.policy_model import MODEL_CONFIG_FILE, build_model, save_levanter_checkpoint
from marinrl.models.tokenizers import byte_tokenizer

VOCAB = 512
TINY = ModelConfig(model=LlamaConfig(seq_len=64, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=2,
                                     num_kv_heads=2, gradient_checkpointing=False), vocab_size=VOCAB, seed=0)
KEY = "serve-test-key-0123456789"
READY = re.compile(r"OpenAI API (\S+), tokens (\S+)$")
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="session")
def verifiers_python() -> str:
    return verifiers_interpreter()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    model = build_model(TINY)
    tokenizer = byte_tokenizer(VOCAB)
    save_levanter_checkpoint(model, str(root / "run" / "step-1"), step=1)
    save_levanter_checkpoint(model, str(root / "run" / "step-4"), step=4)
    save_hf_checkpoint(model, str(root / "hf"), tokenizer=tokenizer)
    tokenizer.save_pretrained(root / "tokenizer")
    return root


class Serving:
    """`marinrl serve ARGS` in a process of its own; its stdout read line by line on a thread."""

    def __init__(self, *args: str, env: dict | None = None):
        self.process = subprocess.Popen([sys.executable, "-m", "marinrl.cli", "serve", *args], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, pattern: re.Pattern, limit_s: float = 300) -> re.Match:
        """The first line of its output matching `pattern`; fails when it exits first (or after `limit_s`)."""
        while True:
            try:
                line = self.lines.get(timeout=limit_s)
            except queue.Empty:
                pytest.fail(f"marinrl serve printed no {pattern.pattern!r} in {limit_s} s:\n" + "\n".join(self.seen))
            if line is None:
                pytest.fail(f"marinrl serve exited ({self.process.wait()}) first:\n" + "\n".join(self.seen))
            self.seen.append(line)
            m = pattern.search(line)
            if m:
                return m

    def stop(self, sig: int) -> int:
        self.process.send_signal(sig)
        code = self.process.wait(timeout=120)
        self.seen.extend(line for line in iter(self.lines.get, None))
        return code

    def kill(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MARINRL_API_KEY"}
    here = str(pathlib.Path(marinrl.__file__).parents[1])  # this checkout's marinrl, in the child too
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    return {**env, **extra}


def _closed(url: str) -> bool:
    host, port = re.match(r"http://([^:/]+):(\d+)", url).groups()
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) != 0


def test_an_hf_checkpoint_serves_openai_and_verifiers_clients(ckpts, verifiers_python):
    serving = Serving(str(ckpts / "hf"), "--port", "0", env=_env(MARINRL_API_KEY=KEY))
    try:
        url, token_url = serving.wait_for(READY).groups()
        assert token_url == url.removesuffix("/v1") + "/inference/v1/generate"
        client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)
        assert [m.id for m in client.models.list()] == ["marinrl-policy"]
        r = client.chat.completions.create(model="marinrl-policy", messages=MESSAGES, max_tokens=5, temperature=1.0,
                                           seed=7, logprobs=True)
        tokenizer = byte_tokenizer(VOCAB)
        prompt = chat_prompt_tokens(tokenizer, MESSAGES)
        assert r.prompt_token_ids == prompt and 1 <= len(r.choices[0].token_ids) <= 5
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()

        (turn,) = run_verifiers_client(verifiers_python, base_url=url, api_key=KEY,
                                       tokenizer_dir=str(ckpts / "tokenizer"),
                                       turns=[[MESSAGES, {"max_tokens": 5, "temperature": 1.0, "seed": 7}]])
        assert turn["prompt_ids"] == prompt
        # the same tokens through the token endpoint directly, with the weight step the checkpoint has (0)
        body = {"token_ids": prompt, "sampling_params": {"max_tokens": 5, "seed": 7, "logprobs": 1,
                                                         "stop_token_ids": [tokenizer.eos_token_id]}}
        direct = httpx.post(token_url, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=300).json()
        (choice,) = direct["choices"]
        assert turn["completion_ids"] == choice["token_ids"]
        assert choice["weight_steps"] == [0] * len(choice["token_ids"])
        np.testing.assert_allclose(turn["completion_logprobs"], [c["logprob"] for c in choice["logprobs"]["content"]],
                                   rtol=1e-6, atol=1e-6)

        assert serving.stop(signal.SIGINT) == 0
        assert serving.seen[-1] == "marinrl serve: stopped" and _closed(url)
        assert not any(KEY in line for line in serving.seen)  # all it printed, start to stop: the key never
    finally:
        serving.kill()


def test_a_levanter_run_folder_serves_its_latest_step_with_a_key_made_at_start(ckpts):
    serving = Serving(str(ckpts / "run"), "--port", "0", "--model-name", "tiny", env=_env())
    try:
        url, token_url = serving.wait_for(READY).groups()
        key = serving.wait_for(re.compile(r"API key .*: (\S+)$")).group(1)
        assert any("step-4 (weight step 4) as 'tiny'" in line for line in serving.seen)
        client = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny"]
        raw = client.post(token_url, body={"token_ids": [256, 104], "sampling_params": {"max_tokens": 3}},
                          cast_to=httpx.Response).json()
        assert raw["choices"][0]["weight_steps"] == [4] * len(raw["choices"][0]["token_ids"])
        assert serving.stop(signal.SIGTERM) == 0 and _closed(url)
    finally:
        serving.kill()


def test_a_busy_server_stops_with_one_line(ckpts):
    """SIGINT while requests are being generated (the first one compiling, likely): the requests in hand are
    answered 503 or cut, and all the server prints after its start is the one line that says it stopped."""
    serving = Serving(str(ckpts / "hf"), "--port", "0", env=_env(MARINRL_API_KEY=KEY))
    done = threading.Event()

    def keep_asking(url):
        body = {"model": "marinrl-policy", "messages": MESSAGES, "n": 64, "max_tokens": 40}
        with httpx.Client(timeout=300, headers={"Authorization": f"Bearer {KEY}"}) as http:
            while not done.is_set():
                try:
                    http.post(f"{url}/chat/completions", json=body)
                except httpx.HTTPError:
                    return

    try:
        url, _ = serving.wait_for(READY).groups()
        started = len(serving.seen)
        askers = [threading.Thread(target=keep_asking, args=(url,), daemon=True) for _ in range(4)]
        for t in askers:
            t.start()
        health = url.removesuffix("/v1") + "/health"
        while httpx.get(health, timeout=60).json()["requests_in_hand"] < 1:
            pass
        assert serving.stop(signal.SIGINT) == 0
        after = serving.seen[started:]
        assert len(after) == 1 and after[0].startswith("marinrl serve: stopped"), after
        assert _closed(url)
    finally:
        done.set()
        serving.kill()


def test_weights_that_do_not_load_are_one_line(ckpts, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in (ckpts / "hf").iterdir():
        data = f.read_bytes()
        (bad / f.name).write_bytes(data[: len(data) // 2] if f.suffix == ".safetensors" else data)
    done = subprocess.run([sys.executable, "-m", "marinrl.cli", "serve", str(bad), "--port", "0"],
                          capture_output=True, text=True, env=_env(), timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(f"marinrl serve: cannot load the weights of {bad}: ")
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def _fails(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        cli(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_bad_input_is_one_line_naming_it(ckpts, tmp_path, capsys):
    missing = str(tmp_path / "nope")
    assert _fails(["serve", missing], capsys) == f"marinrl serve: checkpoint not found: {missing}"
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "weights.bin").write_bytes(b"x")
    assert "junk is neither a Levanter checkpoint" in _fails(["serve", str(tmp_path / "junk")], capsys)
    err = _fails(["serve", str(ckpts / "hf"), "--host", "0.0.0.0"], capsys)
    assert err.startswith("marinrl serve: --host 0.0.0.0 lets other machines reach the endpoint")
    assert "--api-key KEY" in err and "$MARINRL_API_KEY" in err and "inference." not in err  # serve's own flags
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = _fails(["serve", str(ckpts / "hf"), "--port", str(port)], capsys)
    assert err.startswith(f"marinrl serve: cannot listen on 127.0.0.1:{port}: ")
    trainer = tmp_path / "trainer" / "step-2"  # a Trainer's checkpoint: no model_config.json
    save_levanter_checkpoint(build_model(TINY), str(trainer), step=2)
    (trainer / MODEL_CONFIG_FILE).unlink()
    assert f"{trainer} has no {MODEL_CONFIG_FILE}" in _fails(["serve", str(trainer)], capsys)


def test_a_missing_path_or_a_taken_port_answers_before_jax_is_imported(ckpts, tmp_path):
    script = ("import sys\nfrom marinrl.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
              "print('loaded:', sorted(m for m in ('jax', 'levanter', 'transformers') if m in sys.modules))\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for argv in ([str(tmp_path / "nope")], [str(ckpts / "hf"), "--port", port]):
            done = subprocess.run([sys.executable, "-c", script, "serve", *argv], capture_output=True, text=True,
                                  env=_env(), timeout=300)
            assert done.stderr.startswith("marinrl serve: ") and done.stdout.strip() == "loaded: []", done
