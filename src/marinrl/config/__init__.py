"""marinrl's configs: every dataclass a job YAML or a worker is configured with, the error types and the
pure range checks, one module per process or concept (docs/architecture.md, "Layers"). Nothing here imports
JAX, Levanter, Ray, torch or transformers, so a bad config answers in a second; the runtime packages build
the parts a config names (`tests/test_layers.py` holds both rules)."""
