"""What the prefill and decode engine processes share: arguments, model, serving loop."""

from __future__ import annotations

import argparse

import grpc
import torch

from engines.kv_cache import PagedKVCache
from engines.model import LlamaModel
from engines.namespace import TINY, model_config, namespace_for_model
from kvstore.process import announce_ready, setup_logging, wait_for_stop_signal


def engine_args(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--master", required=True, help="kvstore master address host:port")
    p.add_argument("--model", default=TINY, help="'tiny' (seeded random) or a HF style folder")
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per KV block / page")
    p.add_argument("--kv-pages", type=int, default=4096, help="pages in the engine's KV cache")
    p.add_argument("--instance-id", default="", help="name in logs and metrics")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--log-level", default="INFO")
    return p


def load_engine(args) -> tuple[LlamaModel, PagedKVCache]:
    setup_logging(args.log_level)
    torch.set_num_threads(args.threads)
    cfg = model_config(args.model)
    model = LlamaModel.random(cfg) if args.model == TINY else LlamaModel.from_pretrained(args.model)
    cache = PagedKVCache.for_model(cfg, args.kv_pages, args.block_tokens)
    return model, cache


def namespace_of(args):
    return namespace_for_model(args.model, args.block_tokens)


async def serve_until_signal(server: grpc.aio.Server, port: int, info: dict, on_stop=None) -> None:
    """Announce READY, run until SIGTERM/SIGINT, stop gracefully."""
    announce_ready(info)
    await wait_for_stop_signal()
    if on_stop is not None:
        on_stop()
    await server.stop(1.0)
