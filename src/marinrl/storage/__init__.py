"""Rollout files and the filesystem calls under them: the Parquet format (`format.py`), the writer and the
reader with its exactly-once cursor (`rollouts.py`), retried fsspec calls (`fs.py`) and the conditional
writes a lease needs (`conditional.py`) (docs/storage.md)."""
