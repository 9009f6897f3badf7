"""Router: stateless front door. Authenticates, validates, tokenizes, picks a worker and relays the
token stream as text. Never imports torch."""
