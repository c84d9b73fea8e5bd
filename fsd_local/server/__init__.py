"""`fsd-local serve`: OpenAI's and Ollama's APIs and the chat page over HTTP (needs the `server` extra: FastAPI
and uvicorn)."""

from fsd_local.server.app import BackgroundServer, create_app, serve

__all__ = ["BackgroundServer", "create_app", "serve"]
