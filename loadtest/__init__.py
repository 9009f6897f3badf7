"""Load tester: seeded request streams against our gRPC API or any OpenAI-compatible SSE server,
measured on the client with the definitions of docs/metrics.md (`python -m loadtest --help`, README.md).

One run, in order: `cli` builds a `RunConfig` (`config`, `lengths`) and starts a `local_server`
when asked -> `sweep` runs each point on each target -> `runner` sends the point's stream
(`arrivals` for when, `workload` for what) through `grpc_client` / `openai_client`, one
`record.RequestRecord` per request -> `summary` reduces the records with `stats` -> `report`
writes Markdown + JSON, `plots` the PNGs, with `environment` (git, machine, server counters).
Never imports torch.
"""
