"""sluice: an LLM serving engine with an OpenAI-compatible API."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from sluice.engine import Engine


def __getattr__(name: str) -> Any:
    # the Engine pulls in torch: import it only when asked for
    if name == "Engine":
        from sluice.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["Engine", "__version__"]
