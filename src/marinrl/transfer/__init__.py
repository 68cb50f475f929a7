"""Weight transfer from the trainer to the rollout workers (docs/weight_transfer.md). The configs are in
config/transfer.py (no JAX, no Ray); `endpoints.py` builds their servers and clients from its `TRANSPORTS`."""
