"""What ``kubectl apply -k DIR`` applies, for the kustomize features deploy/kubernetes
uses: ``resources`` (files, and directories holding a kustomization), ``labels`` without
selectors, ``images`` and ``patches`` (strategic merge: maps merge key by key, lists of
named items merge by ``name``, ``strategy`` keeps only the patch's keys as
``retainKeys`` does, other lists are replaced). Anything else in a kustomization fails
the test, so a new feature cannot slip past these checks unrendered. (Checked against
``kubectl kustomize`` v5.5 when the overlay was written; CI has no kubectl.)"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

KNOWN_KEYS = {"apiVersion", "kind", "labels", "resources", "images", "patches"}
#: Fields whose patch replaces the base's map instead of merging (retainKeys).
RETAIN_KEYS = {"strategy"}


def kustomization(directory: Path) -> dict[str, Any]:
    k: dict[str, Any] = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert set(k) <= KNOWN_KEYS, f"{directory}: unrendered kustomize keys {set(k) - KNOWN_KEYS}"
    assert k["kind"] == "Kustomization"
    return k


def merge(base: Any, patch: Any, key: str = "") -> Any:
    """Strategic merge of ``patch`` into ``base`` (for the subset described above)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        if key in RETAIN_KEYS:
            return copy.deepcopy(patch)
        out = copy.deepcopy(base)
        for k, v in patch.items():
            out[k] = merge(out[k], v, k) if k in out else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and _named(base) and _named(patch):
        out_list = copy.deepcopy(base)
        index = {item["name"]: i for i, item in enumerate(out_list)}
        head = []
        for item in patch:
            if item["name"] in index:
                out_list[index[item["name"]]] = merge(out_list[index[item["name"]]], item)
            else:
                head.append(copy.deepcopy(item))
        return head + out_list  # kustomize puts new named items first
    return copy.deepcopy(patch)


def _named(items: list[Any]) -> bool:
    return bool(items) and all(isinstance(i, dict) and "name" in i for i in items)


def _same_object(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["kind"] == b["kind"] and a["metadata"]["name"] == b["metadata"]["name"]


def render(directory: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl apply -k directory`` applies (see the module doc)."""
    k = kustomization(directory)
    docs: list[dict[str, Any]] = []
    for res in k.get("resources", []):
        path = directory / res
        if path.is_dir():
            docs.extend(render(path))
        else:
            docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    for p in k.get("patches", []):
        assert set(p) == {"path"}, f"only strategic-merge patch files are rendered: {p}"
        patch = yaml.safe_load((directory / p["path"]).read_text())
        targets = [i for i, d in enumerate(docs) if _same_object(d, patch)]
        assert len(targets) == 1, f"{p['path']} patches {len(targets)} objects"
        docs[targets[0]] = merge(docs[targets[0]], patch)
    images = {i["name"]: i for i in k.get("images", [])}
    for doc in docs:
        for lab in k.get("labels", []):
            assert not lab.get("includeSelectors"), "selectors are immutable: keep them"
            doc["metadata"].setdefault("labels", {}).update(lab["pairs"])
        pod = doc.get("spec", {}).get("template", {}).get("spec", {})
        for c in pod.get("containers", []):
            name = c["image"].split(":")[0]
            if name in images:
                img = images[name]
                c["image"] = f'{img.get("newName", name)}:{img["newTag"]}'
    return docs


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """The only object of ``kind`` among ``docs``."""
    [doc] = [d for d in docs if d["kind"] == kind]
    return doc
