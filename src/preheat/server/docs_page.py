"""``/docs``: the API reference as one self-contained HTML page, built from the server's own
OpenAPI document. No script, stylesheet or font from elsewhere: a pod without internet shows it
(FastAPI's Swagger UI loads its assets from a CDN, and is blank there)."""

from __future__ import annotations

import html
import json
from typing import Any

__all__ = ["render"]

_STYLE = """body{font:15px/1.45 system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#222}
code,td.t{font-family:ui-monospace,monospace;font-size:13px}table{border-collapse:collapse;width:100%;margin:.5rem 0 1.5rem}
td,th{border-bottom:1px solid #ddd;padding:.3rem .5rem;text-align:left;vertical-align:top}
.m{font-weight:600;text-transform:uppercase;width:4rem}h2{margin-top:2rem}"""


def _ref_name(schema: dict[str, Any]) -> str | None:
    ref = schema.get("$ref") or next((s.get("$ref") for s in schema.get("anyOf", []) + schema.get("allOf", [])
                                      if "$ref" in s), None)
    return ref.rsplit("/", 1)[-1] if ref else None


def _type(schema: dict[str, Any]) -> str:
    if "enum" in schema:
        return " | ".join(json.dumps(v) for v in schema["enum"])
    name = _ref_name(schema)
    if name:
        return name
    if "anyOf" in schema:
        return " | ".join(_type(s) for s in schema["anyOf"])
    if schema.get("type") == "array":
        return f"array of {_type(schema.get('items', {}))}"
    return str(schema.get("type", "any"))


def _bounds(schema: dict[str, Any]) -> str:
    parts = [f"{label} {schema[key]}" for key, label in (("minimum", ">="), ("exclusiveMinimum", ">"),
                                                         ("maximum", "<="), ("exclusiveMaximum", "<"),
                                                         ("maxLength", "length <="))
             if key in schema]
    for sub in schema.get("anyOf", []):
        inner = _bounds(sub)
        parts += [inner] if inner else []
    return ", ".join(parts)


def render(spec: dict[str, Any]) -> str:
    """The page for an OpenAPI document: every operation, then every schema's fields."""
    e = html.escape
    rows = []
    for path, ops in spec.get("paths", {}).items():
        for method, op in ops.items():
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
            takes = _ref_name(body)
            link = f' <a href="#{e(takes)}">{e(takes)}</a>' if takes else ""
            rows.append(f'<tr><td class="m">{e(method)}</td><td><code>{e(path)}</code></td>'
                        f"<td>{e(op.get('summary', ''))}{link}</td></tr>")
    schemas = []
    for name, schema in spec.get("components", {}).get("schemas", {}).items():
        props = schema.get("properties", {})
        if not props:
            continue
        required = set(schema.get("required", []))
        fields = "".join(
            f"<tr><td><code>{e(field)}</code>{' (required)' if field in required else ''}</td>"
            f'<td class="t">{e(_type(p))}</td><td class="t">{e(json.dumps(p["default"]) if "default" in p else "")}</td>'
            f"<td>{e(_bounds(p))}</td><td>{e(p.get('description', ''))}</td></tr>"
            for field, p in props.items())
        schemas.append(f'<h3 id="{e(name)}">{e(name)}</h3><table><tr><th>field</th><th>type</th><th>default</th>'
                       f"<th>bounds</th><th>description</th></tr>{fields}</table>")
    info = spec.get("info", {})
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{e(info.get('title', 'API'))} API</title>"
            f"<style>{_STYLE}</style></head><body><h1>{e(info.get('title', ''))} {e(info.get('version', ''))}</h1>"
            f"<p>{e(info.get('description', ''))} The machine-readable document: "
            f'<a href="/openapi.json">/openapi.json</a>.</p><h2>Endpoints</h2><table>{"".join(rows)}</table>'
            f"<h2>Schemas</h2>{''.join(schemas)}</body></html>")
