#!/usr/bin/env python3
"""Writes `src/ratchet_client/models.py`: pydantic models generated from Ratchet's OpenAPI
document by datamodel-code-generator.

    python scripts/generate_models.py http://127.0.0.1:7700/openapi.json
    python scripts/generate_models.py path/to/openapi.json [--output FILE] [--check]

The output depends only on the document: the document is always handed to the generator
under the same file name, without a timestamp, and the generator's version is the one
`.ci/requirements.txt` pins (it refuses to run with another). `--check` writes nothing and
exits 1 when the file differs from what the document generates.

The document is read as it is but for one thing: an object schema written out in full where
it repeats a named one (each page's `items`) becomes a reference to that one, so that a page
of sessions holds `SessionView`s rather than a model named after its position.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any, Dict

#: The version `.ci/requirements.txt` pins: another version formats the models differently.
GENERATOR_VERSION = "0.97.0"
PACKAGE_DIR = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = PACKAGE_DIR / "src" / "ratchet_client" / "models.py"
HEADER = (
    "# Pydantic models of Ratchet's HTTP API, generated from its OpenAPI document by\n"
    "# scripts/generate_models.py: change the server's schemas and run it again; never edit\n"
    "# this file by hand."
)
GENERATOR_OPTIONS = [
    "--input-file-type", "openapi",
    "--output-model-type", "pydantic_v2.BaseModel",
    "--target-python-version", "3.10",
    "--no-use-union-operator",
    "--use-standard-collections",
    "--enum-field-as-literal", "all",
    "--use-schema-description",
    "--use-field-description",
    "--field-constraints",
    "--collapse-root-models",
    "--use-double-quotes",
    "--formatters", "builtin",
    "--disable-timestamp",
    "--custom-file-header", HEADER,
]


def load(source: str) -> Dict[str, Any]:
    """The document at an `http(s)://` URL or in a file."""
    if source.startswith(("http://", "https://")):
        with urllib.request.urlopen(source, timeout=30) as answer:
            return json.load(answer)
    return json.loads(Path(source).read_text(encoding="utf-8"))


def reference_named_objects(document: Dict[str, Any]) -> Dict[str, Any]:
    """The document with every object schema that repeats a named one in full (a page's
    items are written out inline) replaced by a reference to it, so that the models name it
    `SessionView`, not `Item6`."""
    named = document.get("components", {}).get("schemas", {})
    names = {
        json.dumps(schema, sort_keys=True): name
        for name, schema in named.items()
        if schema.get("type") == "object" and "properties" in schema
    }

    def referenced(node: Any) -> Any:
        if isinstance(node, dict):
            name = names.get(json.dumps(node, sort_keys=True))
            if name is not None:
                return {"$ref": f"#/components/schemas/{name}"}
            return {key: referenced(value) for key, value in node.items()}
        if isinstance(node, list):
            return [referenced(value) for value in node]
        return node

    schemas = {
        name: {key: referenced(value) for key, value in schema.items()}
        for name, schema in named.items()
    }
    return {**document, "components": {**document["components"], "schemas": schemas}}


def inline_named_strings(document: Dict[str, Any]) -> Dict[str, Any]:
    """The document with every reference to a named string schema (an id with its pattern,
    a cursor) replaced by that schema, so that a field holds a plain `str` — one a caller
    compares with the ids it has — whether it is required or may be null."""
    named = document.get("components", {}).get("schemas", {})
    strings = {
        f"#/components/schemas/{name}": schema
        for name, schema in named.items()
        if schema.get("type") == "string" and "enum" not in schema
    }

    def inlined(node: Any) -> Any:
        if isinstance(node, dict):
            if node.get("$ref") in strings and set(node) <= {"$ref", "description"}:
                rest = {k: v for k, v in node.items() if k != "$ref"}
                return {**strings[node["$ref"]], **rest}
            choices = node.get("oneOf")
            if isinstance(choices, list) and len(choices) == 2 and {"type": "null"} in choices:
                (other,) = [inlined(c) for c in choices if c != {"type": "null"}]
                if other.get("type") == "string" and "enum" not in other:
                    rest = {k: inlined(v) for k, v in node.items() if k != "oneOf"}
                    return {**other, **rest, "type": ["string", "null"]}
            return {key: inlined(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inlined(value) for value in node]
        return node

    return inlined(document)


def generate(document: Dict[str, Any]) -> str:
    """The source of `models.py` for `document`."""
    installed = importlib.metadata.version("datamodel-code-generator")
    if installed != GENERATOR_VERSION:
        raise SystemExit(
            f"datamodel-code-generator {installed} is installed; the models are generated "
            f"with {GENERATOR_VERSION} (pip install -r .ci/requirements.txt)"
        )
    with tempfile.TemporaryDirectory() as scratch:
        # A fixed name: the generator writes it into the header.
        document_path = Path(scratch) / "openapi.json"
        document = inline_named_strings(reference_named_objects(document))
        document_path.write_text(json.dumps(document, indent=2), encoding="utf-8")
        output_path = Path(scratch) / "models.py"
        subprocess.run(
            [
                sys.executable, "-m", "datamodel_code_generator",
                "--input", str(document_path),
                "--output", str(output_path),
                *GENERATOR_OPTIONS,
            ],
            check=True,
            cwd=scratch,
        )
        return output_path.read_text(encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="URL or file path of the OpenAPI document")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument(
        "--check", action="store_true", help="compare with the file instead of writing it"
    )
    args = parser.parse_args()
    source = generate(load(args.source))
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        if current != source:
            print(f"{args.output} is not what {args.source} generates", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(source, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
