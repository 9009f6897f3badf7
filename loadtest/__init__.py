"""Load tester: seeded request streams against our gRPC API or any OpenAI-compatible SSE server,
measured on the client with the definitions of METRICS.md (`python -m loadtest --help`).

One run, in order: `cli` builds a `RunConfig` -> `workload` + `arrivals` precompute the request
stream from the seed -> `runner` sends it through a client (`grpc_client` / `openai_client`)
and fills one `RequestRecord` per request -> `summary` reduces records to statistics (`stats`) ->
`report` writes JSON + Markdown, `plots` writes PNGs. Never imports torch.
"""
