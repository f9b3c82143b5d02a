"""Turn CustomResourceDefinition YAML into strict JSON Schema files for check-jsonschema.

    python deploy/schemas/crd_to_jsonschema.py OUT_DIR CRD.yaml [CRD.yaml ...]

For every served version of every CRD it writes ``OUT_DIR/<group>/<kind lowercase>_<version>.json``: the version's
``openAPIV3Schema`` with

* every ``description`` removed, written as compact JSON (the InferenceService schema: 2.0 MB of YAML, 0.7 MB
  of JSON; the constraints are unchanged);
* ``additionalProperties: false`` on each object that lists ``properties`` and neither sets
  ``additionalProperties`` nor ``x-kubernetes-preserve-unknown-fields``: the API server prunes unknown fields
  silently, so a misspelt key would otherwise pass; here it is an error (as ``kubectl apply --validate=strict``);
* ``apiVersion`` and ``kind`` pinned to the CRD's group/version and kind, and both plus ``metadata`` (an object)
  required.

The ``x-kubernetes-*`` keywords stay; JSON Schema validators ignore unknown keywords.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml


def _strict(node: object) -> object:
    if isinstance(node, dict):
        out = {k: _strict(v) for k, v in node.items() if k != "description" or not isinstance(v, str)}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


def convert(crd: dict) -> dict[str, dict]:
    """{relative output path: JSON schema} for each served version of ``crd``."""
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    out = {}
    for version in crd["spec"]["versions"]:
        if not version.get("served", True):
            continue
        schema = _strict(version["schema"]["openAPIV3Schema"])
        props = schema.setdefault("properties", {})
        props["apiVersion"] = {"type": "string", "enum": [f"{group}/{version['name']}"]}
        props["kind"] = {"type": "string", "enum": [kind]}
        props.setdefault("metadata", {"type": "object"})  # some CRDs (Istio's) leave it out of their schema
        schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata"})
        schema = {"$schema": "http://json-schema.org/draft-07/schema#",
                  "title": f"{kind} {group}/{version['name']}", **schema}
        out[f"{group}/{kind.lower()}_{version['name']}.json"] = schema
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out_dir = Path(argv[0])
    for path in argv[1:]:
        for doc in yaml.safe_load_all(Path(path).read_text(encoding="utf-8")):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            for rel, schema in convert(doc).items():
                target = out_dir / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(json.dumps(schema, sort_keys=True, separators=(",", ":")) + "\n", encoding="utf-8")
                print(f"{path} -> {target} ({target.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
