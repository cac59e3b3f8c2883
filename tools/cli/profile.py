"""``kvstore profile``: fit a cost model to the bundled torch engine on this machine.

Measures the three quantities the conductor's cost model predicts
(:mod:`kvstore.conductor.cost_model`) and fits its coefficients:

* prefill: :meth:`kvstore.engines.model.LlamaModel.prefill` of ``new`` tokens after
  ``cached`` tokens whose KV is already in the pages (as a prefill engine does
  after loading a cached prefix), over a grid of both;
* decode: one :meth:`~kvstore.engines.model.LlamaModel.decode` step of a batch of
  ``b`` sequences with ``c`` context tokens each;
* transfer: moving ``n`` bytes over a loopback TCP connection with
  ``recv_into`` a preallocated buffer (how the store's TCP data path moves a
  block), over a range of sizes.

Each point is the minimum of ``repeats`` runs (the least disturbed by other
work). The model is the engine's (``--model tiny`` by default), run with the
engine's page size and thread count; it takes well under a minute for tiny.
The JSON records what was measured, where and when, in ``source``.

Thread safety: a CLI; runs in the calling thread (plus one socket thread).
"""

from __future__ import annotations

import json
import logging
import platform
import socket
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import typer

from kvstore.conductor.cost_model import CostModel, cost_models_dir, fit_decode, fit_prefill, fit_transfer

logger = logging.getLogger(__name__)

PREFILL_NEW_TOKENS = (16, 128, 512)
PREFILL_CACHED_TOKENS = (0, 512, 1536, 3072)
DECODE_BATCH_SIZES = (1, 4, 16)
DECODE_CONTEXT_TOKENS = (64, 512, 1024)
TRANSFER_SIZES_BYTES = (64 << 10, 1 << 20, 8 << 20, 32 << 20)


def _best_ms(fn: Callable[[], None], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - t0) * 1000)
    return best


def measure_prefill(model, cache, new_tokens: Sequence[int], cached_tokens: Sequence[int],
                    repeats: int, vocab_size: int) -> list[tuple[int, int, float]]:
    """``(new, cached, ms)`` for every pair; ``cached`` is a multiple of the page size."""
    from kvstore.engines.kv_cache import Sequence as Seq

    rng = np.random.default_rng(0)
    out = []
    for cached in cached_tokens:
        for new in new_tokens:
            tokens = rng.integers(1, vocab_size, size=cached + new).tolist()
            seq = Seq("profile")

            def run() -> None:
                cache.reserve(seq, len(tokens))
                try:
                    cache.mark_computed(seq, cached)
                    model.prefill(seq, cache, tokens)
                finally:
                    cache.free(seq)

            out.append((new, cached, _best_ms(run, repeats)))
    return out


def measure_decode(model, cache, batch_sizes: Sequence[int], context_tokens: Sequence[int],
                   repeats: int) -> list[tuple[int, int, float]]:
    """``(batch, total context, ms)`` of one decode step for every pair."""
    from kvstore.engines.kv_cache import Sequence as Seq

    out = []
    for ctx in context_tokens:
        for b in batch_sizes:
            seqs = [Seq(f"profile-{i}") for i in range(b)]
            try:
                for s in seqs:
                    cache.reserve(s, ctx + 1)
                    cache.mark_computed(s, ctx)

                def run() -> None:
                    model.decode(seqs, cache, [1] * b)
                    for s in seqs:
                        s.num_computed = ctx  # the same step again

                out.append((b, b * ctx, _best_ms(run, repeats)))
            finally:
                for s in seqs:
                    cache.free(s)
    return out


def measure_transfer(sizes_bytes: Sequence[int], repeats: int) -> list[tuple[int, float]]:
    """``(bytes, ms)`` of sending each size over loopback TCP into a preallocated buffer."""
    out = []
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    sender = socket.create_connection(("127.0.0.1", port))
    receiver, _ = listener.accept()
    listener.close()
    try:
        for size in sizes_bytes:
            payload = bytes(size)
            buf = bytearray(size)
            view = memoryview(buf)

            def run() -> None:
                t = threading.Thread(target=sender.sendall, args=(payload,))
                t.start()
                got = 0
                while got < size:
                    n = receiver.recv_into(view[got:], size - got)
                    if n == 0:
                        raise ConnectionError("loopback closed")
                    got += n
                t.join()

            out.append((size, _best_ms(run, repeats)))
    finally:
        sender.close()
        receiver.close()
    return out


def _max_rel_err(samples, predict) -> float:
    return max(abs(predict(*s[:-1]) - s[-1]) / s[-1] for s in samples)


def profile(model_name: str = "tiny", block_tokens: int = 16, threads: int = 1, repeats: int = 3,
            kv_pages: int = 4096, prefill_cache_bytes: int = 512 << 20, name: str | None = None,
            log: Callable[[str], None] = lambda _m: None) -> tuple[CostModel, dict]:
    """Measures the engine and fits a cost model.

    Args:
        model_name: "tiny" (seeded random weights) or a Hugging Face style folder.
        block_tokens: the engines' page size (the store's block size).
        threads: torch intra-op threads (as the engines' ``--threads``).
        repeats: runs per point; the minimum is kept.
        kv_pages: pages of a decode engine's KV cache (its ``--kv-pages``).
        prefill_cache_bytes: local KVCache pool of a prefill instance (a store
            node's DRAM tier).
        name: the model's name; default "<model>-cpu".
        log: progress messages.

    Returns:
        The fitted model and the raw samples.
    """
    import torch

    from kvstore.engines.kv_cache import PagedKVCache
    from kvstore.engines.model import LlamaModel
    from kvstore.client.models import model_config

    torch.set_num_threads(threads)
    cfg = model_config(model_name)
    model = LlamaModel.random(cfg) if model_name == "tiny" else LlamaModel.from_pretrained(model_name)
    need_pages = max(max(DECODE_BATCH_SIZES) * (max(DECODE_CONTEXT_TOKENS) // block_tokens + 2),
                     (max(PREFILL_NEW_TOKENS) + max(PREFILL_CACHED_TOKENS)) // block_tokens + 2)
    cache = PagedKVCache.for_model(cfg, need_pages, block_tokens)
    started = time.perf_counter()
    log("prefill ...")
    pre = measure_prefill(model, cache, PREFILL_NEW_TOKENS, PREFILL_CACHED_TOKENS, repeats, cfg.vocab_size)
    log("decode ...")
    dec = measure_decode(model, cache, DECODE_BATCH_SIZES, DECODE_CONTEXT_TOKENS, repeats)
    log("transfer ...")
    xfer = measure_transfer(TRANSFER_SIZES_BYTES, max(repeats, 3))
    p0, p1, p2 = fit_prefill(pre)
    d0, d1, d2 = fit_decode(dec)
    t0, bw = fit_transfer(xfer)
    where = (f"measured by tools/cli/profile.py on {platform.node() or 'this host'} "
             f"({platform.processor() or platform.machine()}, torch {torch.__version__}, "
             f"{threads} thread(s)) on {time.strftime('%Y-%m-%d')}")
    kv_bytes = cfg.kv_bytes_per_token(4)
    cm = CostModel(
        name=name or f"{Path(model_name).name}-cpu", block_tokens=block_tokens, kv_bytes_per_token=kv_bytes,
        prefill_base_ms=p0, prefill_ms_per_token=p1, prefill_ms_per_mpair=p2,
        decode_base_ms=d0, decode_ms_per_seq=d1, decode_ms_per_kctx=d2,
        transfer_base_ms=t0, transfer_bytes_per_ms=bw,
        decode_kv_capacity_tokens=kv_pages * block_tokens, prefill_cache_bytes=prefill_cache_bytes,
        hardware=f"engines' {model_name} Llama in float32 on CPU, {block_tokens}-token pages",
        source={})
    fit_err = {
        "prefill": _max_rel_err(pre, cm.prefill_ms),
        "decode": _max_rel_err(dec, cm.decode_step_ms),
        "transfer": _max_rel_err(xfer, cm.transfer_ms),
    }
    src = {
        "prefill_base_ms": f"fit to LlamaModel.prefill, new x cached tokens in {PREFILL_NEW_TOKENS} x "
                           f"{PREFILL_CACHED_TOKENS}, {where}; max relative error {fit_err['prefill']:.0%}",
        "decode_base_ms": f"fit to LlamaModel.decode, batch x context/seq in {DECODE_BATCH_SIZES} x "
                          f"{DECODE_CONTEXT_TOKENS}, {where}; max relative error {fit_err['decode']:.0%}",
        "transfer_base_ms": f"fit to loopback TCP sends of {[s >> 10 for s in TRANSFER_SIZES_BYTES]} KiB "
                            f"into a preallocated buffer, {where}; max relative error {fit_err['transfer']:.0%}",
        "kv_bytes_per_token": f"ModelConfig.kv_bytes_per_token(4): float32 K and V of {cfg.num_layers} layers",
        "decode_kv_capacity_tokens": f"{kv_pages} pages of {block_tokens} tokens (the engines' --kv-pages)",
        "prefill_cache_bytes": "a store node's DRAM tier (the demo's --node-dram default)",
    }
    for k in ("prefill_ms_per_token", "prefill_ms_per_mpair"):
        src[k] = "see prefill_base_ms"
    for k in ("decode_ms_per_seq", "decode_ms_per_kctx"):
        src[k] = "see decode_base_ms"
    src["transfer_bytes_per_ms"] = "see transfer_base_ms"
    cm = cm.with_overrides(source=src)
    samples = {"prefill": pre, "decode": dec, "transfer": xfer, "fit_max_rel_err": fit_err,
               "elapsed_s": time.perf_counter() - started}
    return cm, samples


def profile_command(
    model: str = typer.Option("tiny", "--model", help="'tiny' or a Hugging Face style folder"),
    out: Optional[str] = typer.Option(None, "--out",
                                      help="JSON path (default: conductor/data/cost_models/<name>.json)"),
    block_tokens: int = typer.Option(16, "--block-tokens", min=1, help="tokens per KV page / block"),
    threads: int = typer.Option(1, "--threads", min=1, help="torch intra-op threads"),
    repeats: int = typer.Option(3, "--repeats", min=1, help="runs per point (the minimum is kept)"),
    kv_pages: int = typer.Option(4096, "--kv-pages", min=1, help="pages of a decode engine's KV cache"),
    json_out: bool = typer.Option(False, "--json", help="print the model as JSON on stdout"),
) -> None:
    """Fit the conductor's cost model (prefill, decode step, transfer) on this machine."""
    from rich.console import Console
    from rich.table import Table

    err = Console(stderr=True)
    cm, samples = profile(model, block_tokens=block_tokens, threads=threads, repeats=repeats,
                          kv_pages=kv_pages, log=lambda m: err.print(f"[dim]{m}[/]"))
    path = Path(out) if out else cost_models_dir() / f"{cm.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    cm.save(path)
    table = Table(title=f"cost model {cm.name} ({samples['elapsed_s']:.0f} s)")
    table.add_column("coefficient")
    table.add_column("value", justify="right")
    for k, v in cm.to_dict().items():
        if k not in ("name", "hardware", "source"):
            table.add_row(k, f"{v:.6g}" if isinstance(v, float) else f"{v:,}")
    for k, v in samples["fit_max_rel_err"].items():
        table.add_row(f"max rel. error, {k}", f"{v:.1%}")
    (err if json_out else Console()).print(table)
    (err if json_out else Console()).print(f"written to {path}")
    if json_out:
        typer.echo(json.dumps(cm.to_dict(), indent=2))


def main() -> None:
    """``python -m kvstore.tools.cli.profile``: the same command, standalone."""
    typer.run(profile_command)


if __name__ == "__main__":
    main()
