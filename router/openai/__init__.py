"""OpenAI-compatible HTTP front of the router (docs/openai.md): `requests` turns OpenAI JSON into a
`GenerateRequest`, `responses` turns relay events back into OpenAI JSON and SSE, `app` is the
FastAPI application over the same `GenerationService` pipeline as gRPC, `server` runs uvicorn in
the router's event loop."""
