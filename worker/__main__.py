"""`python -m worker --port N [--model PATH]` serves one engine over gRPC (see --help)."""
import argparse
import asyncio
import sys

from common import telemetry
from common.logs import setup_logging
from common.net import is_loopback_host
from worker.config import EngineConfig
from worker.server import WorkerServerConfig, serve


def parse_args(argv: list[str] | None = None) -> WorkerServerConfig:
    p = argparse.ArgumentParser(prog="python -m worker", description="LLM worker (gRPC)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 = ephemeral (printed at start-up)")
    p.add_argument("--allow-insecure-public", action="store_true",
                   help="bind a non-loopback address without mutual TLS")
    g = p.add_argument_group("transport security (PEM files)")
    g.add_argument("--tls-cert", default=None, help="TLS certificate chain of this worker")
    g.add_argument("--tls-key", default=None, help="private key of --tls-cert")
    g.add_argument("--tls-client-ca", default=None,
                   help="require client (router) certificates signed by this CA: mutual TLS")
    p.add_argument("--drain-grace-s", type=float, default=10.0,
                   help="SIGTERM: how long open streams may finish")
    p.add_argument("--drain-announce-s", type=float, default=2.0,
                   help="SIGTERM: report NOT_SERVING but keep accepting calls this long first, so "
                        "routers stop routing here (set above the routers' --health-poll-s)")
    p.add_argument("--model", default=None, help="GGUF file or HF dir (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-mb", type=float, default=None, help="KV cache budget (CPU), MiB")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attention-backend", choices=("auto", "torch", "reference", "triton"), default="auto",
                   help="auto: triton on CUDA, torch on CPU; reference: the slow float32 oracle")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="CUDA: fraction of the free memory after loading weights for the KV pool (0.85)")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: never replay CUDA graphs")
    p.add_argument("--no-prefix-caching", action="store_true", help="never reuse cached prompt blocks")
    telemetry.add_args(p, default_metrics_port=0)
    a = p.parse_args(argv)
    missing = [flag for flag, value in (("--tls-cert", a.tls_cert), ("--tls-key", a.tls_key),
                                        ("--tls-client-ca", a.tls_client_ca)) if value is None]
    if not is_loopback_host(a.host) and missing and not a.allow_insecure_public:
        p.error(f"refusing to bind {a.host} without mutual TLS (missing {', '.join(missing)}): "
                "routers authenticate to workers only by client certificate; pass them, or "
                "--allow-insecure-public on a private network")
    overrides = {k: v for k, v in {
        "kv_cache_bytes": None if a.kv_cache_mb is None else int(a.kv_cache_mb * 2**20),
        "max_num_seqs": a.max_num_seqs, "max_num_batched_tokens": a.max_num_batched_tokens,
        "max_model_len": a.max_model_len, "num_threads": a.num_threads,
        "gpu_memory_utilization": a.gpu_memory_utilization,
    }.items() if v is not None}
    engine = EngineConfig(model=a.model, dtype=a.dtype, device=a.device, block_size=a.block_size,
                          seed=a.seed, attention_backend=a.attention_backend, enforce_eager=a.enforce_eager,
                          enable_prefix_caching=not a.no_prefix_caching, **overrides)
    return WorkerServerConfig(engine=engine, host=a.host, port=a.port, drain_grace_s=a.drain_grace_s,
                              drain_announce_s=a.drain_announce_s,
                              telemetry=telemetry.from_args(a), tls_cert=a.tls_cert, tls_key=a.tls_key,
                              tls_client_ca=a.tls_client_ca)


def main() -> int:
    try:
        config = parse_args()
    except ValueError as exc:  # a bad flag value or unreadable TLS file: a usage error, not a traceback
        raise SystemExit(f"python -m worker: error: {exc}") from None
    setup_logging("worker", config.telemetry.log_format)
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
