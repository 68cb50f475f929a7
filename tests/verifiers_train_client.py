"""Runs in the verifiers virtualenv's interpreter, not in ours (tests/test_token_endpoint.py starts it): one
chat turn through verifiers 0.4's own `TrainClient`, which renders the conversation to token ids with the
`renderers` package and posts them to our `/inference/v1/generate`.

    python verifiers_train_client.py '{"base_url": ..., "api_key": ..., "tokenizer": DIR, "model": ...,
                                        "turns": [[messages, sampling], ...]}'

prints one JSON line per turn: the tokens and logprobs verifiers keeps for training (`Response.tokens`),
its finish reason and parsed text, or `{"error": ..., "status_code": ...}` for a turn that failed.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from renderers import DefaultRendererConfig
from verifiers.v1.clients import TrainClientConfig, resolve_client
from verifiers.v1.dialects import ChatDialect
from verifiers.v1.types import SamplingConfig

KEY_VARIABLE = "MARINRL_ENDPOINT_API_KEY"


async def main(args: dict) -> None:
    os.environ[KEY_VARIABLE] = args["api_key"]  # verifiers reads the key from a variable it is named
    config = TrainClientConfig(base_url=args["base_url"], api_key_var=KEY_VARIABLE,
                               renderer=DefaultRendererConfig(), renderer_model_name=args["tokenizer"])
    client = resolve_client(config)
    try:
        for messages, sampling in args["turns"]:
            body = {"model": args["model"], "messages": messages}
            try:
                r = await client.get_response(ChatDialect(), body, SamplingConfig(**sampling), session_id="test")
            except Exception as e:  # noqa: BLE001 - reported to the test
                print(json.dumps({"error": str(e), "status_code": getattr(e, "status_code", None)}), flush=True)
                continue
            t = r.tokens
            print(json.dumps({"prompt_ids": t.prompt_ids, "completion_ids": t.completion_ids,
                              "completion_logprobs": t.completion_logprobs, "finish_reason": r.finish_reason,
                              "content": r.message.content}), flush=True)
    finally:
        await client.close()


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
