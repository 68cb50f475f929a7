"""`marinrl serve CHECKPOINT`: a checkpoint behind the OpenAI-compatible and token endpoints (docs/inference.md)."""

from __future__ import annotations

import argparse
import os

from marinrl.cli.errors import InputError
from marinrl.cli.eval import add_checkpoint_arguments
from marinrl.config.checks import is_loopback

API_KEY_VARIABLE = "MARINRL_API_KEY"
"""Where `marinrl serve` reads its API key when `--api-key` is not given (a flag shows in `ps`)."""


def run(args: argparse.Namespace) -> int:
    from marinrl.config.serve import ServeConfig
    from marinrl.config.server import EngineConfig, InferenceServerConfig

    api_key = args.api_key or os.environ.get(API_KEY_VARIABLE) or None
    if api_key is None and not is_loopback(args.host):
        raise InputError(f"--host {args.host} lets other machines reach the endpoint, so it needs an API key: "
                         f"set ${API_KEY_VARIABLE} (e.g. export {API_KEY_VARIABLE}=\"$(openssl rand -hex 32)\") or "
                         "pass --api-key KEY, and send it as 'Authorization: Bearer <key>'; or serve on "
                         "--host 127.0.0.1")
    try:
        model = None
        if args.model_config:
            from marinrl.eval import load_model_config

            model = load_model_config(args.model_config)
        inference = InferenceServerConfig(
            backend=args.backend, serve_http=True, host=args.host, port=args.port,
            api_key=api_key, model_name=args.model_name,
            default_max_tokens=args.default_max_tokens, dtype=args.dtype,
            engine=EngineConfig(max_seq_len=args.max_seq_len))
        config = ServeConfig(checkpoint=args.checkpoint, inference=inference, model=model, tokenizer=args.tokenizer,
                             weight_step=args.weight_step)
    except (FileNotFoundError, ValueError) as e:
        raise InputError(str(e)) from e
    from marinrl import serve  # JAX and Levanter load only after the checks that need neither (serve.start)

    try:
        return serve.main(config)
    except (ValueError, OSError) as e:  # eval.CheckpointLoadError is a ValueError
        raise InputError(str(e)) from e


def add_parser(sub) -> None:
    """The `serve` subcommand's arguments."""
    p = sub.add_parser("serve", help="serve a checkpoint: the OpenAI-compatible endpoint and the token endpoint",
                       description="Serve a Levanter or Hugging Face checkpoint over HTTP until Ctrl-C or SIGTERM: "
                                   "/v1/chat/completions, /v1/completions, /v1/models and the token endpoint "
                                   "/inference/v1/generate (what verifiers' train client calls). See "
                                   "docs/inference.md.")
    p.add_argument("checkpoint",
                   help="Levanter step-N directory or a run's checkpoint folder (latest step), or an HF checkpoint dir")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1); any other (e.g. 0.0.0.0) needs an API key")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free port)")
    p.add_argument("--api-key", default=None,
                   help=f"the key every request must send as 'Authorization: Bearer <key>' (default: "
                        f"${API_KEY_VARIABLE}, else a random key printed at start)")
    p.add_argument("--model-name", default="marinrl-policy", help="the model name the endpoint reports")
    add_checkpoint_arguments(p, engine="engine: continuous batching, and models the scan sampler does not run")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="serve the weights in this dtype (default: --model-config's dtype, else float32)")
    p.add_argument("--max-seq-len", type=int, default=512,
                   help="engine backend: the longest prompt + generation (default 512)")
    p.add_argument("--default-max-tokens", type=int, default=256,
                   help="the token budget of a request that gives none (default 256)")
    p.add_argument("--weight-step", type=int, default=None,
                   help="the weight step reported on every token (default: the checkpoint's)")
    p.set_defaults(run=run)
