"""GET /openapi.json (filled out with every route and body by the hardening work)."""

from __future__ import annotations


def spec(model_name: str) -> dict:
    return {
        "openapi": "3.0.3",
        "info": {"title": "tokenline", "version": "0.1.0",
                 "description": f"OpenAI-compatible serving of {model_name}"},
        "paths": {},
    }
