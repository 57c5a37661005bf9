"""Built-in Kubernetes objects (NetworkPolicy, Service, pod templates) checked offline against
the API's own schema, as the ``kubernetes`` Python client carries it.

Each model class of the client (``kubernetes.client.V1NetworkPolicy``, ...) lists its fields
in ``attribute_map`` (Python name -> JSON name) and their types in ``openapi_types``
(``str``, ``int``, ``bool``, ``float``, ``datetime``, ``object``, ``List[T]``, ``Dict[str, T]``
or another model's name). From 37.0 the classes are pydantic models as well; their field
information says which fields are required and what an ``object`` field takes (an
int-or-string such as a port, or any JSON).

The API server drops fields it does not know (or refuses them with ``kubectl apply
--validate=strict``); here they are errors, as in ``kuberay_schema``, so a misspelt field
fails instead of vanishing. Types are checked all the way down; values within a type
(enumerations, DNS names) are not.
"""

import datetime
import re
import typing
from functools import cache

import kubernetes.client

_SCALARS = {"str": (str,), "int": (int,), "bool": (bool,), "float": (int, float), "bytes": (str,),
            "datetime": (str, datetime.datetime), "date": (str, datetime.date)}
_LIST = re.compile(r"(?:List|list)\[(.+)\]")
_DICT = re.compile(r"(?:Dict\[str, |dict\(str, )(.+)[\])]")
_ANY = object()  # an ``object`` field that takes any JSON


def model_class(api_version: str, kind: str) -> type:
    """The client's class for a top-level object: ``networking.k8s.io/v1`` ``NetworkPolicy`` ->
    ``V1NetworkPolicy`` (the client names models by version and kind, not by group)."""
    version = api_version.rpartition("/")[2]
    cls = getattr(kubernetes.client, version[:1].upper() + version[1:] + kind, None)
    if cls is None or not hasattr(cls, "openapi_types"):
        raise KeyError(f"no model for {api_version} {kind} in kubernetes {kubernetes.__version__}")
    return cls


@cache
def _fields(cls: type) -> dict[str, tuple[str, bool, tuple | object]]:
    """JSON name -> (openapi type, required, what an ``object`` field takes)."""
    pydantic_fields = {info.serialization_alias or info.alias or name: info
                       for name, info in getattr(cls, "model_fields", {}).items()}
    fields = {}
    for attr, json_name in cls.attribute_map.items():
        info = pydantic_fields.get(json_name)
        fields[json_name] = (cls.openapi_types[attr], bool(info and info.is_required()), _object_types(info))
    return fields


def _object_types(info) -> tuple | object:
    """The scalar types an ``object`` field's pydantic annotation allows (int and str for an
    int-or-string), or _ANY when it allows anything else (or the client says nothing)."""
    if info is None:
        return _ANY
    allowed = []
    for arg in typing.get_args(info.annotation) or (info.annotation,):
        base = typing.get_args(arg)[0] if typing.get_origin(arg) is typing.Annotated else arg
        if base is type(None):
            continue
        if base not in (int, str, float, bool):
            return _ANY
        allowed.append(base)
    return tuple(allowed) or _ANY


def _type_name(value) -> str:
    return "null" if value is None else type(value).__name__


def type_errors(value, openapi_type: str, path: str = "", object_types: tuple | object = _ANY) -> list[str]:
    """Where ``value`` (plain YAML/JSON data) differs from ``openapi_type``, one line each."""
    where = path or "(root)"
    if openapi_type == "object":
        if object_types is _ANY or (isinstance(value, object_types) and not (
                isinstance(value, bool) and bool not in object_types)):
            return []
        return [f"{where}: {_type_name(value)} {value!r}, expected {' or '.join(t.__name__ for t in object_types)}"]
    if openapi_type in _SCALARS:
        types = _SCALARS[openapi_type]
        if isinstance(value, types) and not (isinstance(value, bool) and openapi_type != "bool"):
            return []
        return [f"{where}: {_type_name(value)} {value!r}, expected {openapi_type}"]
    if match := _LIST.fullmatch(openapi_type):
        if not isinstance(value, list):
            return [f"{where}: {_type_name(value)}, expected a list"]
        return [e for i, item in enumerate(value) for e in type_errors(item, match[1], f"{path}.{i}".lstrip("."))]
    if match := _DICT.fullmatch(openapi_type):
        if not isinstance(value, dict):
            return [f"{where}: {_type_name(value)}, expected a mapping"]
        errors = [f"{where}: key {key!r} is not a string" for key in value if not isinstance(key, str)]
        return errors + [e for key, item in value.items() for e in type_errors(item, match[1], f"{path}.{key}".lstrip("."))]
    cls = getattr(kubernetes.client, openapi_type, None)
    if cls is None or not hasattr(cls, "attribute_map"):
        raise KeyError(f"{where}: unknown type {openapi_type!r} in kubernetes {kubernetes.__version__}")
    return model_errors(value, cls, path)


def model_errors(value, cls: type, path: str = "") -> list[str]:
    """``value`` against one model class: a mapping with only its fields, each of its type, the
    required ones present; a null stands for an absent field."""
    where = path or "(root)"
    if not isinstance(value, dict):
        return [f"{where}: {_type_name(value)}, expected a {cls.__name__} mapping"]
    fields = _fields(cls)
    errors = [f"{where}: unknown field {key!r} ({cls.__name__} has {', '.join(sorted(fields))})"
              for key in value if key not in fields]
    for name, (openapi_type, required, object_types) in fields.items():
        field_path = f"{path}.{name}".lstrip(".")
        if value.get(name) is None:
            if required:
                errors.append(f"{field_path}: required")
            continue
        errors += type_errors(value[name], openapi_type, field_path, object_types)
    return errors


def k8s_errors(manifest: dict) -> list[str]:
    """A top-level object (apiVersion, kind, metadata, spec, ...) against its model; [] when it
    matches. Names what is wrong by its path, e.g. ``spec.ingress.0.ports.0.port``."""
    return model_errors(manifest, model_class(manifest["apiVersion"], manifest["kind"]))
