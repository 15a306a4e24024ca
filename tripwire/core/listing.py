"""The runs under a root folder (`tripwire ls`): found by their manifests, one or two levels down."""

from __future__ import annotations

from .run import open_run
from .store import MANIFEST


def list_runs(root: str, storage_options: dict | None = None) -> list[dict]:
    import fsspec

    fs, path = fsspec.core.url_to_fs(root, **(storage_options or {}))
    path = path.rstrip("/")
    fs.invalidate_cache()
    found = set()
    for pattern in (f"{path}/{MANIFEST}", f"{path}/*/{MANIFEST}", f"{path}/*/*/{MANIFEST}"):
        found.update(fs.glob(pattern))
    local = "file" in ((fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol)
    rows = []
    for manifest in sorted(found):
        folder = manifest.rsplit("/", 1)[0]
        url = folder if local else fs.unstrip_protocol(folder)
        try:
            run = open_run(url, storage_options)
            info = run.info
            steps = max((len(run.steps(mode=m)) for m in run.modes()), default=0)
            verdicts = run.verdicts()
            rows.append({"name": folder[len(path):].strip("/") or ".", "url": url,
                         "framework": info.get("framework"), "steps": steps, "status": info["status"],
                         "created": info.get("created"), "verdicts": sum(v.fired for v in verdicts)})
        except Exception as exc:  # noqa: BLE001 - one broken run must not hide the others
            rows.append({"name": folder[len(path):].strip("/"), "url": url, "framework": None, "steps": 0,
                         "status": f"unreadable: {exc}", "created": None, "verdicts": 0})
    return sorted(rows, key=lambda r: (r["created"] or 0, r["name"]))
