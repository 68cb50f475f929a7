"""A real OpenEnv environment server for tests/test_openenv.py, built with openenv-core's server API
(`Environment`, `Action`, `Observation`, `create_app`) and served by uvicorn on localhost:

    python tests/openenv_server.py --port 8123

The game: the observation shows a letter (`c>`); the action's `message` must repeat it. A right answer
earns 1 and ends the episode; a wrong one earns 0 and the environment answers `no c>` (two tries).
An action's `delay` makes the step sleep that many seconds (for the client's timeouts). GET /stats
reports the sessions opened and the most open at once (for the client's concurrency bound)."""

from __future__ import annotations

import argparse
import random
import threading
import time

import uvicorn
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

STATS = {"opened": 0, "open": 0, "max_open": 0}
_LOCK = threading.Lock()


class LetterAction(Action):
    message: str
    delay: float = 0.0


class LetterObservation(Observation):
    prompt: str = ""
    letter: str = ""


class LetterEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)
        self.letter = "a"
        with _LOCK:
            STATS["opened"] += 1
            STATS["open"] += 1
            STATS["max_open"] = max(STATS["max_open"], STATS["open"])

    def reset(self, seed: int | None = None) -> LetterObservation:
        self.letter = random.Random(seed).choice("abcd")
        self._state = State(step_count=0)
        return LetterObservation(prompt=f"{self.letter}>", letter=self.letter, reward=0.0, done=False)

    def step(self, action: LetterAction) -> LetterObservation:  # type: ignore[override]
        time.sleep(action.delay)
        self._state.step_count += 1
        right = action.message == self.letter
        done = right or self._state.step_count >= 2
        return LetterObservation(prompt="" if done else f"no {self.letter}>", letter=self.letter,
                                 reward=float(right), done=done)

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        with _LOCK:
            STATS["open"] -= 1


app = create_app(LetterEnvironment, LetterAction, LetterObservation, env_name="letters", max_concurrent_envs=64)


@app.get("/stats")
def stats() -> dict:
    with _LOCK:
        return dict(STATS)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    uvicorn.run(app, host="127.0.0.1", port=parser.parse_args().port, log_level="warning")
