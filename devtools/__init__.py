"""Developer and test tools: not part of a deployment, and nothing under common/, router/ or worker/
imports them.

- devtools.local: worker(s) + router as plain loopback processes, no Ray (`python -m devtools.local`;
  `LocalProcess`, which benchmarks/ and loadtest's local stack start processes with).
- devtools.otlp_sink: an in-memory OTLP/gRPC trace receiver (the collector end of tests and
  benchmarks; `python -m devtools.otlp_sink` prints spans while developing).
- devtools.client: the command-line gRPC client (`python -m devtools.client`).
- devtools.stalled_client: a client that stops reading its streams (the trust soak and tests).
"""
