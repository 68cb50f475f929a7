"""The replay buffer: which rollouts a train step may use (docs/replay.md). `buffer.py` holds the buffer;
what a file's groups go through before they enter (`ingest.py`), the usable window of weight steps
(`staleness.py`), group filters (`filters.py`) and sampling strategies (`sampling.py`) are its parts. The
strategies and filters are registered choices of the config layer (config/replay.py); their NumPy code is
here, under the same names."""
