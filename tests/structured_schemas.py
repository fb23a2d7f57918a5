"""The JSON Schemas the structured-output tests constrain to (issue 11's acceptance set).

Nested objects, arrays, enums, numbers with bounds, optional fields, a recursive one, unions,
constants and patterns. Strings carry a ``maxLength`` and arrays a ``maxItems``, as a service
would give a small model: the fake model (random-ish logits) and a 135M model would otherwise
wander in an open string until ``max_tokens`` cuts the JSON short.
"""

from __future__ import annotations

from typing import Any

NAME: dict[str, Any] = {"type": "string", "minLength": 1, "maxLength": 12}

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested_address": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": NAME,
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": NAME,
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "int_array": {
        "type": "array",
        "items": {"type": "integer", "minimum": -10, "maximum": 10},
        "minItems": 1,
        "maxItems": 5,
    },
    "enums": {
        "type": "object",
        "properties": {
            "status": {"enum": ["active", "inactive", "banned"]},
            "level": {"enum": [1, 2, 3]},
        },
        "required": ["status", "level"],
        "additionalProperties": False,
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "celsius": {"type": "number", "minimum": -50, "maximum": 60},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 1000},
        },
        "required": ["celsius", "ratio", "count"],
        "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 99999},
            "nickname": NAME,
            "score": {"type": "number", "minimum": 0, "maximum": 10},
        },
        "required": ["id"],
        "additionalProperties": False,
    },
    "recursive_tree": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "value": {"type": "integer", "minimum": 0, "maximum": 9},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
                "required": ["value", "children"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/node",
    },
    "nullable_and_bool": {
        "type": "object",
        "properties": {
            "flag": {"type": "boolean"},
            "nothing": {"type": "null"},
            "maybe": {"anyOf": [NAME, {"type": "null"}]},
        },
        "required": ["flag", "nothing", "maybe"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "integer", "minimum": 0, "maximum": 999},
                        "label": NAME,
                    },
                    "required": ["sku", "label"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    "long_fixed_keys": {
        "type": "object",
        "properties": {
            "schema_version": {"const": "2024-06-01"},
            "customer_account_identifier": {"type": "integer", "minimum": 0, "maximum": 9999},
            "is_subscription_currently_active": {"type": "boolean"},
            "preferred_contact_channel": {"enum": ["email", "phone", "postal_mail"]},
        },
        "required": [
            "schema_version",
            "customer_account_identifier",
            "is_subscription_currently_active",
            "preferred_contact_channel",
        ],
        "additionalProperties": False,
    },
    "pattern_codes": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 3},
        },
        "required": ["code", "tags"],
        "additionalProperties": False,
    },
    "union_shapes": {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "kind": {"const": "circle"},
                    "radius": {"type": "number", "minimum": 0, "maximum": 100},
                },
                "required": ["kind", "radius"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {
                    "kind": {"const": "rect"},
                    "w": {"type": "integer", "minimum": 0, "maximum": 100},
                    "h": {"type": "integer", "minimum": 0, "maximum": 100},
                },
                "required": ["kind", "w", "h"],
                "additionalProperties": False,
            },
        ]
    },
}

# Refused at the router (and by the engine), each naming the problem.
BAD_SCHEMAS: dict[str, tuple[str, str]] = {
    # name: (schema text, a phrase the error message contains)
    "not_json": ('{"type": "object",', "not valid JSON"),
    "not_an_object": ("[1, 2]", "must be an object"),
    "unknown_type": ('{"type": "frobnicate"}', "frobnicate"),
    "look_around": (
        '{"type": "string", "pattern": "(?<=a)b"}',
        "look-around",
    ),
    "remote_ref": ('{"$ref": "https://example.com/schema.json"}', "example.com"),
}
