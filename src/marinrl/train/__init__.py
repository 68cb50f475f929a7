"""The trainer: `TrainWorker` (`worker.py`) around Levanter's `Trainer`, the replay buffer (`replay/`), packed
batches (`batching.py`, `packing.py`), the GRPO-family loss as pure functions (`losses.py`, `advantages.py`,
`mismatch.py`, `policy_forward.py`), checkpoints and the audit trail (docs/training.md)."""
