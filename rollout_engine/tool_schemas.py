"""The tools a request offers: their names and the JSON schemas of their parameters, the schemas' shapes checked
when they arrive (a request's schema the checker cannot read is the request's error, found before any token is
generated), and a call's arguments checked against its tool's top-level schema."""
from __future__ import annotations

from collections.abc import Mapping

__all__ = ["check_arguments", "tool_names"]


def tool_names(tools) -> dict[str, dict | None]:
    """name -> JSON schema of its parameters (None when unknown), from OpenAI-style tool dicts
    ({"type": "function", "function": {"name", "parameters"}}), bare {"name", "parameters"} dicts, or names."""
    if isinstance(tools, (str, Mapping)):  # iterating them would make tools of its characters or keys
        raise ValueError(f"tools must be a list of tools (names or schema dicts), not a {type(tools).__name__}: "
                         "wrap a single one in a list")
    out = {}
    for t in tools or ():
        if isinstance(t, str):
            t = {"name": t}
        if not isinstance(t, Mapping):
            raise ValueError(f"a tool must be a name or a JSON-schema dict, got {type(t).__name__}")
        spec = t.get("function", t)
        name = spec.get("name") if isinstance(spec, Mapping) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"tool {t!r} has no name")
        if name in out:  # a call names its tool: two of one name would leave which one it is unknown
            raise ValueError(f"tools holds two tools named {name!r}; tool names must differ")
        params = spec.get("parameters")
        out[name] = _checked_schema(name, params) if isinstance(params, Mapping) else None
    return out


def _checked_schema(tool: str, schema: Mapping) -> Mapping:
    """`schema`, if check_arguments can read it: the keywords it reads have their JSON Schema shapes."""
    def refuse(where: str, what: str):
        raise ValueError(f"tool {tool!r}: parameters{where} must be {what}")

    props = schema.get("properties", {})
    if not isinstance(props, Mapping) or not all(isinstance(p, (Mapping, bool)) for p in props.values()):
        refuse(".properties", "an object of schemas (objects or booleans)")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        refuse(".required", "a list of names")
    extra = schema.get("additionalProperties", True)
    if not isinstance(extra, (bool, Mapping)):
        refuse(".additionalProperties", "a boolean or a schema (object)")
    for where, spec in [(f".properties.{k}", v) for k, v in props.items()] + [(".additionalProperties", extra)]:
        if not isinstance(spec, Mapping):
            continue
        kind = spec.get("type", "string")
        if not (isinstance(kind, str) or isinstance(kind, list) and all(isinstance(k, str) for k in kind)):
            refuse(f"{where}.type", "a type name or a list of them")
        if not isinstance(spec.get("enum", []), list):
            refuse(f"{where}.enum", "a list")
    return schema


_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "object": (dict,), "array": (list,), "null": (type(None),)}


def _type_ok(value, kind) -> bool:
    kinds = kind if isinstance(kind, list) else [kind]
    for k in kinds:
        types = _JSON_TYPES.get(k)
        if types is None:
            return True  # a type this checker does not know: accept
        if isinstance(value, bool) and k in ("integer", "number"):
            continue
        if isinstance(value, types):
            return True
        if k == "integer" and isinstance(value, float) and value.is_integer():
            return True  # JSON Schema draft 6+: an integer is a number with no fractional part, 2.0 included
    return False


def _json_equal(a, b) -> bool:
    """JSON Schema's equality (for `enum`): the same JSON type and value. Numbers compare by value (1 and 1.0 are
    equal), a boolean is never a number (True is not 1, as Python's == has it), arrays and objects item by item."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(map(_json_equal, a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def check_arguments(name: str, arguments: dict, schema: Mapping | None) -> str | None:
    """What is wrong with `arguments` under the tool's top-level JSON schema, or None."""
    if not schema:
        return None
    props = schema.get("properties") or {}
    missing = [p for p in schema.get("required") or () if p not in arguments]
    if missing:
        return f"{name} needs the argument(s) {missing}"
    # Undeclared arguments are errors unless the schema allows them explicitly, true or a schema they then meet
    # (a model inventing arguments should hear about it).
    extra = schema.get("additionalProperties")
    unknown = [a for a in arguments if a not in props]
    if unknown and extra in (None, False) and (props or extra is False):
        return f"{name} has no argument(s) {unknown}; its arguments are {sorted(props)}"
    for arg, value in arguments.items():
        spec = props.get(arg, extra)
        if isinstance(spec, Mapping) and "type" in spec and not _type_ok(value, spec["type"]):
            return f"argument {arg!r} of {name} must be of type {spec['type']}, got {type(value).__name__}"
        if isinstance(spec, Mapping) and "enum" in spec and not any(_json_equal(value, m) for m in spec["enum"]):
            return f"argument {arg!r} of {name} must be one of {spec['enum']}, got {value!r}"
    return None
