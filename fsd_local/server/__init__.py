"""`fsd-local serve`: OpenAI's and Ollama's APIs and the chat page over HTTP (needs the `server` extra: FastAPI
and uvicorn)."""

from fsd_local.server.app import create_app, create_supervised_app
from fsd_local.server.running import BackgroundServer, serve

__all__ = ["BackgroundServer", "create_app", "create_supervised_app", "serve"]
