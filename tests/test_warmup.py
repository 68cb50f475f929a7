"""The rollout worker compiles its sampler before weight step 0 arrives (marinrl/rollout/warmup.py):
the first eval and the first batch then add no compiled shape. Real parts: the session's tiny
InferenceServer, the echo environment, filesystem weight transfer, a RolloutWriter on a tmp dir."""

from __future__ import annotations

import faulty_envs

from marinrl.config.rollout_worker import ModelStream, RolloutWorkerConfig
from marinrl.config.transfer import FilesystemTransferConfig
from marinrl.envs.toy import EchoEnv
from marinrl.inference.context import SamplingParams
from marinrl.inference.sampler import compiled_shapes
from marinrl.rollout.manager import LessonRuntime, RolloutManager
from marinrl.rollout.worker import RolloutWorker
from marinrl.transfer.endpoints import build_client, build_server

LESSON = "echo-warm"


class OneLesson:
    def sample_lesson(self, seed: int) -> str:
        return LESSON


class CompileWatch:
    """A tracker that notes the sampler's compiled shapes when the worker logs each kind of event, and
    publishes weight step 1 (the run's last) once the first batch is written, as a trainer would."""

    def __init__(self, publisher, model):
        self.publisher, self.model = publisher, model
        self.at: dict[str, int] = {}

    def log(self, metrics, *, step, commit=None):
        for kind, prefix in (("weights", "weights/"), ("eval", "eval/"), ("batch", "rollout/batches_written")):
            if any(k.startswith(prefix) for k in metrics):
                self.at.setdefault(kind, compiled_shapes())  # the first time each kind is logged
        if "rollout/batches_written" in metrics and metrics["rollout/batches_written"] == 1:
            self.publisher.publish(self.model, 1)


def make_worker(tmp_path, server, make_env, **overrides):
    # shapes no other test uses (22-token prompts, 48 new tokens, groups of 3, 5 eval prompts): the
    # compiles counted here are this test's own
    sampling = SamplingParams(temperature=1.0, max_tokens=48)
    manager = RolloutManager(server, {LESSON: LessonRuntime(make_env, sampling, env_name="echo")})
    weights = FilesystemTransferConfig(root=f"file://{tmp_path}/weights")
    publisher = build_server(weights)
    config = RolloutWorkerConfig(streams=(ModelStream("policy", (), f"{tmp_path}/rollouts", weights),),
                                 groups_per_batch=3, n_generations=3, max_staleness=0, final_step=1,
                                 eval_examples=5, weight_timeout_s=120.0, **overrides)
    tracker = CompileWatch(publisher, server.model)
    clients = {"policy": build_client(weights, server.model)}
    return (RolloutWorker(config, manager, OneLesson(), clients=clients, worker_id="w0", tracker=tracker), publisher,
            tracker)


def test_after_the_warm_up_the_first_eval_and_batch_compile_nothing(tmp_path, tiny_server):
    worker, publisher, watch = make_worker(tmp_path, tiny_server, lambda: EchoEnv(alphabet_size=26, length=20))
    publisher.publish(tiny_server.model, 0)
    before = compiled_shapes()
    try:
        summary = worker.run()
    finally:
        publisher.close()
    assert summary["weight_step"] == 1 and summary["batches_written"] >= 1
    assert [e["weight_step"] for e in summary["evals"]] == [0, 1]
    # the warm-up compiled the train shape (3 samples of 3 prompts) and the eval shape (1 of 5)
    assert watch.at["weights"] - before == 2
    # step 0's eval, the first batch, step 1's reload and its eval: no compile
    assert watch.at["eval"] == watch.at["batch"] == compiled_shapes() == watch.at["weights"]
    assert "warm_up" in worker.startup.phases and "first_batch" in worker.startup.phases


def test_an_environment_failing_in_the_warm_up_only_warms_less(tmp_path, tiny_server):
    worker, publisher, _ = make_worker(tmp_path, tiny_server, faulty_envs.RaisesInSample)
    try:
        assert worker.warm_up() == {}
    finally:
        publisher.close()
    assert worker.counters.sample_failures == 0 and worker.counters.eval_failures == 0
