"""The rollout side: `RolloutWorker` (`worker.py`: weights in, rollout files out, evals, metrics) around the
stateless `RolloutManager` (`manager.py`: server, environments, curriculum handle); `policy_router.py` sends
each agent to its policy's model (docs/architecture.md)."""
