"""`python -m devtools.client "prompt"` (or `llm-serve generate`): stream a generation from the router.

Text goes to stdout as it arrives; usage and timings go to stderr at the end. Exit status is 0 on
success, 1 with the gRPC status on failure. Sampling flags left out are left unset in the request,
so the server applies the model's own generation defaults (docs/serving.md, "Generation
defaults"); `--temperature 0` asks for greedy decoding.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc

from common.tls import channel_credentials
from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import generation_pb2_grpc

REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_CANCELLED: "cancelled",
}


def build_request(a: argparse.Namespace) -> pb.GenerateRequest:
    req = pb.GenerateRequest(model=a.model, priority=a.priority)
    if a.chat:
        messages = [pb.ChatMessage(role="system", content=a.system)] if a.system else []
        messages.append(pb.ChatMessage(role="user", content=a.prompt))
        req.chat.messages.extend(messages)
    else:
        req.prompt = a.prompt
    for name in ("temperature", "top_p", "seed"):
        if getattr(a, name) is not None:
            setattr(req.sampling, name, getattr(a, name))
    req.sampling.top_k = a.top_k
    req.sampling.logprobs = 1 if a.logprobs else 0
    if a.max_tokens is not None:
        req.stopping.max_tokens = a.max_tokens
    req.stopping.stop.extend(a.stop)
    req.stopping.ignore_eos = a.ignore_eos
    if a.json:
        req.response_format.json_object = True
    elif a.json_schema:
        schema = a.json_schema
        if not schema.lstrip().startswith("{"):  # a file
            with open(schema, encoding="utf-8") as f:
                schema = f.read()
        req.response_format.json_schema = schema
    elif a.regex:
        req.response_format.regex = a.regex
    elif a.choice:
        req.response_format.choice.options.extend(a.choice)
    elif a.grammar:
        grammar = a.grammar
        if os.path.isfile(grammar):
            with open(grammar, encoding="utf-8") as f:
                grammar = f.read()
        req.response_format.grammar = grammar
    return req


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m devtools.client", description=__doc__.splitlines()[0])
    p.add_argument("prompt")
    p.add_argument("--target", default="127.0.0.1:50051", help="router address")
    p.add_argument("--api-key", default=os.environ.get("LLM_API_KEY"), help="default: $LLM_API_KEY")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    p.add_argument("--system", default="", help="system message (with --chat)")
    p.add_argument("--model", default="", help="model id (required when the router serves several)")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the model's)")
    p.add_argument("--top-p", type=float, default=None, help="default: the model's")
    p.add_argument("--top-k", type=int, default=0, help="0 = the model's default (or off)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", action="store_true", help="print the mean logprob at the end")
    p.add_argument("--priority", type=int, default=0)
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="structured output: a JSON object")
    fmt.add_argument(
        "--json-schema", default=None, help="structured output: a JSON Schema (JSON text or a file)"
    )
    fmt.add_argument("--regex", default=None, help="structured output: text matching this regex")
    fmt.add_argument("--choice", nargs="+", default=None, help="structured output: one of these strings")
    fmt.add_argument(
        "--grammar", default=None, help="structured output: a Lark or GBNF grammar (the text or a file)"
    )
    p.add_argument("--timeout-s", type=float, default=None, help="deadline for the whole call")
    p.add_argument("--tls", action="store_true", help="connect over TLS, trusting the system's CAs")
    p.add_argument("--tls-ca", default=None, help="connect over TLS, trusting this CA (PEM)")
    p.add_argument("--tls-cert", default=None, help="client certificate (PEM) for a router that requires one")
    p.add_argument("--tls-key", default=None, help="private key of --tls-cert")
    p.add_argument(
        "--tls-server-name",
        default=None,
        help="name the router's certificate carries, when it is not --target's host "
        "(e.g. through a port forward)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    try:
        credentials = (
            channel_credentials(a.tls_ca, a.tls_cert, a.tls_key)
            if a.tls or a.tls_ca or a.tls_cert or a.tls_key or a.tls_server_name
            else None
        )
    except ValueError as exc:
        p.error(str(exc))

    metadata = [("authorization", f"Bearer {a.api_key}")] if a.api_key else []
    logprobs: list[float] = []
    options = [("grpc.ssl_target_name_override", a.tls_server_name)] if a.tls_server_name else []
    with (
        grpc.secure_channel(a.target, credentials, options=options)
        if credentials
        else grpc.insecure_channel(a.target)
    ) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            for msg in stub.Generate(build_request(a), metadata=metadata, timeout=a.timeout_s):
                if msg.HasField("chunk"):
                    sys.stdout.write(msg.chunk.text)
                    sys.stdout.flush()
                    logprobs.extend(msg.chunk.logprobs)
                else:
                    f = msg.finished
                    print(flush=True)
                    print(
                        f"[{REASONS.get(f.reason, 'unspecified')}] prompt {f.usage.prompt_tokens} "
                        f"(cached {f.usage.cached_prompt_tokens}), completion "
                        f"{f.usage.completion_tokens} tokens; queue {f.timing.queue_ms:.0f} ms, "
                        f"TTFT {f.timing.ttft_ms:.0f} ms, total {f.timing.total_ms:.0f} ms",
                        file=sys.stderr,
                    )
                    if logprobs:
                        print(f"mean logprob {sum(logprobs) / len(logprobs):.3f}", file=sys.stderr)
        except grpc.RpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("\n[cancelled]", file=sys.stderr)
            return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
