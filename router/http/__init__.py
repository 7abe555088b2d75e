"""The router's OpenAI-compatible HTTP API (FastAPI on uvicorn), beside its gRPC server.

schemas.py (request bodies) -> app.py (routes) -> bridge.py (orchestrator on a thread) ->
answer.py (response shapes), stops.py (stop strings), errors.py (OpenAI error bodies),
server.py (`start_http`).
"""
