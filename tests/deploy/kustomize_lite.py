"""Render a kustomization without a kustomize binary, for the tests of deploy/k8s.

`render(path)` uses `kubectl kustomize` or `kustomize build` when one is on PATH, else
`render_lite(path)`: a loader for the small subset our overlays use (kustomize's own
semantics, re-implemented from its documentation):

- `resources`: YAML files (several documents each) and directories holding a kustomization;
- `patches` with `path` or an inline `patch`: a mapping is a strategic-merge patch (its target is
  the object of the same kind and metadata.name; mappings merge key by key, lists of mappings
  merge element by element on their merge key, `name` or a volume mount's `mountPath`, new
  elements first as kustomize does; other lists are replaced); a list is a JSON 6902 patch
  (`add` and `replace`, JSON pointers with `-` for the end of a list) on the object `target`
  names by kind and name.

Anything else in a kustomization raises `UnsupportedKustomization`: keep the overlays simple
enough for this loader (the test that compares it with kubectl, where kubectl is installed,
keeps the two in step).
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

_SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "patches"}
# Strategic-merge keys of the lists our patches touch (Kubernetes' patchMergeKey tags).
_MERGE_KEYS = {"volumeMounts": "mountPath", "ports": "containerPort"}


class UnsupportedKustomization(ValueError):
    """A kustomization uses a feature `render_lite` does not implement."""


def render(path: Path) -> list[dict[str, Any]]:
    """The objects of the kustomization in directory `path`, rendered by kubectl or kustomize
    when installed, else by `render_lite`.

    Raises subprocess.CalledProcessError when the binary refuses the kustomization, and
    UnsupportedKustomization from `render_lite`."""
    if shutil.which("kubectl"):
        command = ["kubectl", "kustomize", str(path)]
    elif shutil.which("kustomize"):
        command = ["kustomize", "build", str(path)]
    else:
        return render_lite(path)
    out = subprocess.run(command, check=True, capture_output=True, text=True, timeout=60).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def render_lite(path: Path) -> list[dict[str, Any]]:
    """The objects of the kustomization in directory `path`, in resource order.

    Raises UnsupportedKustomization for a key, patch or operation outside the subset above,
    and KeyError when a patch's target is not among the resources."""
    kustomization = yaml.safe_load((path / "kustomization.yaml").read_text())
    unsupported = set(kustomization) - _SUPPORTED_KEYS
    if unsupported:
        raise UnsupportedKustomization(f"{path}: unsupported keys {sorted(unsupported)}")
    objects: list[dict[str, Any]] = []
    for resource in kustomization.get("resources", []):
        target = path / resource
        if target.is_dir():
            objects.extend(render_lite(target))
        else:
            objects.extend(doc for doc in yaml.safe_load_all(target.read_text()) if doc)
    for entry in kustomization.get("patches", []):
        text = (path / entry["path"]).read_text() if "path" in entry else entry["patch"]
        patch = yaml.safe_load(text)
        if isinstance(patch, dict):
            obj = _find(objects, patch["kind"], patch["metadata"]["name"])
            obj.update(_strategic_merge(obj, patch))
        elif isinstance(patch, list) and "target" in entry:
            obj = _find(objects, entry["target"]["kind"], entry["target"]["name"])
            for op in patch:
                _json6902(obj, op)
        else:
            raise UnsupportedKustomization(f"{path}: patch {entry} is neither kind")
    return objects


def _find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for obj in objects:
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise KeyError(f"no {kind}/{name} to patch")


def _strategic_merge(base: Any, patch: Any, key: str | None = None) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for k, v in patch.items():
            merged[k] = _strategic_merge(base[k], v, k) if k in base else copy.deepcopy(v)
        return merged
    merge_key = _MERGE_KEYS.get(key or "", "name")
    if (
        isinstance(base, list)
        and isinstance(patch, list)
        and all(isinstance(item, dict) and merge_key in item for item in base + patch)
    ):
        by_key = {item[merge_key]: item for item in patch}
        merged_list = [
            _strategic_merge(item, by_key[item[merge_key]]) if item[merge_key] in by_key else item
            for item in base
        ]
        old_keys = {item[merge_key] for item in base}
        # kustomize puts the patch's new elements first, in the patch's order.
        return [copy.deepcopy(i) for i in patch if i[merge_key] not in old_keys] + merged_list
    return copy.deepcopy(patch)


def _json6902(obj: dict[str, Any], op: dict[str, Any]) -> None:
    if op["op"] not in ("add", "replace"):
        raise UnsupportedKustomization(f"JSON patch op {op['op']!r}")
    *parents, last = op["path"].lstrip("/").split("/")
    node: Any = obj
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    value = copy.deepcopy(op["value"])
    if isinstance(node, list):
        if last == "-":
            node.append(value)
        elif op["op"] == "add":
            node.insert(int(last), value)
        else:
            node[int(last)] = value
    else:
        node[last] = value
