"""Twenty JSON schemas of the shapes structured output and tool arguments meet: strings
with bounded patterns, enums, bounded integers, nested objects, arrays, const, anyOf."""

NAME = {"type": "string", "pattern": "^[a-z]{1,8}$"}
SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 99}


def obj(props: dict, required=None, extra=False) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None
            else required, "additionalProperties": extra}


SCHEMAS = [
    obj({"name": NAME}),
    obj({"age": SMALL_INT}),
    obj({"ok": {"type": "boolean"}}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"status": {"type": "string", "enum": ["open", "closed"]}, "count": SMALL_INT}),
    obj({"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}}),
    obj({"point": obj({"x": SMALL_INT, "y": SMALL_INT})}),
    obj({"user": obj({"name": NAME, "address": obj({"zip": {"type": "string",
                                                               "pattern": "^[0-9]{5}$"}})})}),
    obj({"a": NAME, "b": SMALL_INT}, required=["a"]),
    obj({"id": {"type": "integer", "minimum": 10, "maximum": 20}}),
    obj({"temp": {"type": "integer", "minimum": -5, "maximum": 5}}),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}),
    obj({"items": {"type": "array", "items": obj({"k": SMALL_INT}), "minItems": 2,
                    "maxItems": 2}}),
    obj({"flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 0,
                    "maxItems": 4}}),
    obj({"kind": {"const": "fixed"}, "n": SMALL_INT}),
    obj({"x": {"anyOf": [SMALL_INT, {"type": "null"}]}}),
    obj({"level": {"enum": [1, 2, 3]}, "name": NAME}),
    {"type": "array", "items": SMALL_INT, "minItems": 1, "maxItems": 3},
    obj({"m": {"type": "array", "items": {"type": "array", "items": SMALL_INT, "minItems": 1,
                                           "maxItems": 2}, "minItems": 1, "maxItems": 2}}),
    obj({"first": NAME, "last": NAME, "nick": NAME}, required=["first", "last"]),
]
assert len(SCHEMAS) == 20
