"""KubeRay's CRD schemas as JSON Schema, for offline validation.

``crds/`` holds KubeRay 1.7's RayService CRD (Apache-2.0), gzipped: the copy in
``../shared/kuberay-crds`` next to a checkout, which a clean clone may not have (a test
keeps the two equal where both exist).

The openAPIV3Schema is JSON Schema but for Kubernetes' extensions: ``nullable``,
``x-kubernetes-int-or-string`` (an int or a string) and ``x-kubernetes-preserve-unknown-fields``
(any fields). The API server prunes fields a schema does not declare; here they are errors
(``additionalProperties: false``), so a misspelt field fails instead of vanishing.
"""

import gzip
from functools import cache
from pathlib import Path

import jsonschema
import yaml

CRDS = Path(__file__).resolve().parent / "crds"
SHARED_CRDS = Path(__file__).resolve().parents[3] / "shared" / "kuberay-crds"


def crd_text(kind: str) -> str:
    return gzip.decompress((CRDS / f"ray.io_{kind.lower()}s.yaml.gz").read_bytes()).decode()


def to_json_schema(node):
    if isinstance(node, list):
        return [to_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    schema = {key: to_json_schema(value) for key, value in node.items()
              if not key.startswith("x-kubernetes-") and key != "nullable"}
    if node.get("x-kubernetes-int-or-string"):
        schema.pop("anyOf", None)
        schema["type"] = ["integer", "string"]
    if node.get("nullable") and "type" in schema:
        schema["type"] = [*([schema["type"]] if isinstance(schema["type"], str) else schema["type"]), "null"]
    if ("properties" in node and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        schema["additionalProperties"] = False
    return schema


@cache
def crd_validator(kind: str, version: str = "v1") -> jsonschema.protocols.Validator:
    crd = yaml.safe_load(crd_text(kind))
    served = {v["name"]: v for v in crd["spec"]["versions"]}
    schema = to_json_schema(served[version]["schema"]["openAPIV3Schema"])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def crd_errors(manifest: dict) -> list[str]:
    group_version = manifest["apiVersion"]
    assert group_version.startswith("ray.io/"), group_version
    validator = crd_validator(manifest["kind"], group_version.split("/")[1])
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(manifest)]
