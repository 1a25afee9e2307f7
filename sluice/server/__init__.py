"""The HTTP process: FastAPI app, OpenAI protocol models and the serving classes."""

from __future__ import annotations

from sluice.server.app import create_app

__all__ = ["create_app"]
