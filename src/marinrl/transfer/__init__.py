"""Weight transfer from the trainer to the rollout workers (docs/weight_transfer.md). The configs are in
`transfer_config.py` (no JAX, no Ray), their servers and clients are built by `endpoints.py`."""
