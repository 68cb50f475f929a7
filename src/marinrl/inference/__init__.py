"""The inference server (`server.py`): token-in/token-out generation with exact logprobs by the scan sampler
(`sampler.py`, `inflight.py`) or Levanter's engine (`levanter_engine.py`), the OpenAI-compatible endpoint
(`openai_api.py`; `openai_requests.py`, `openai_responses.py`, `generate_queue.py`) and its token route
(`token_endpoint.py`), and the context environments call (`context.py`) (docs/inference.md)."""
