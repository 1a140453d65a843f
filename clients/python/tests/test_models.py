"""The checked-in models are what the generator makes of the running server's document."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import httpx

from conftest import Server

PACKAGE_DIR = Path(__file__).resolve().parent.parent


def load_generator():
    path = PACKAGE_DIR / "scripts" / "generate_models.py"
    spec = importlib.util.spec_from_file_location("generate_models", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_models_match_the_servers_openapi_document(server: Server) -> None:
    document = httpx.get(f"{server.url}/openapi.json", timeout=30).raise_for_status().json()
    generator = load_generator()
    checked_in = generator.DEFAULT_OUTPUT.read_text(encoding="utf-8")
    assert generator.generate(document) == checked_in, (
        "src/ratchet_client/models.py is out of date: run "
        f"`python scripts/generate_models.py {server.url}/openapi.json`"
    )
