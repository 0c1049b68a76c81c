"""_hub.py: a model's config.json from the local Hugging Face cache, never downloaded.

The same lookup as the command's `--hf-model` (tools/hf_model.cpp): huggingface_hub keeps
each repository under $HF_HUB_CACHE (default $HF_HOME/hub, HF_HOME defaulting to
$XDG_CACHE_HOME/huggingface or ~/.cache/huggingface) as models--<org>--<name>, whose
refs/main names the snapshot holding config.json (huggingface_hub's constants.py and
file_download.py, try_to_load_from_cache).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

# huggingface_hub's validate_repo_id: [org/]name, no "--" or ".." inside, no '-' or '.' at either end.
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?/)?[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?$")
_COMMIT = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


def hub_cache() -> Path:
    """Where huggingface_hub keeps what it downloaded."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "huggingface" / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def _fetch_hint(name: str) -> str:
    return (f"`huggingface-cli download {name} config.json` (or `hf download`) fetches the config alone, no weights; "
            "or give the folder that holds its config.json, or a config.json itself")


def find_hf_config(name: str) -> Path:
    """The config.json of `name`: a folder holding one, or a Hub repository id ("org/name")
    found in the local cache. Raises ValueError saying where it looked and what to do."""
    path = Path(name)
    if name and path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{name}: the folder has no config.json; give a folder holding one, or a Hub model "
                             "name such as meta-llama/Llama-3.1-8B found in the Hugging Face cache")
        return path / "config.json"
    if name and path.is_file():
        raise ValueError(f"{name}: a file; give its folder, or the file itself as the config")
    if len(name) > 96 or ".." in name or "--" in name or not _REPO_ID.match(name):
        raise ValueError(f"{name}: not a folder, and not a Hub model name (org/name of letters, digits, '-', '_' "
                         "and '.')")
    cache = hub_cache()
    repo = cache / ("models--" + name.replace("/", "--"))
    if not repo.is_dir():
        raise ValueError(f"{name}: not in the Hugging Face cache ({cache}; $HF_HUB_CACHE or $HF_HOME set it); "
                         + _fetch_hint(name))
    ref = repo / "refs" / "main"
    commit = ""
    if ref.is_file():
        with open(ref, "rb") as f:  # a commit hash: the first line of at most 256 bytes
            lines = f.read(256).decode("ascii", errors="replace").splitlines()
            commit = lines[0].strip() if lines else ""
    found = []
    if _COMMIT.match(commit) and commit not in (".", ".."):
        found = [repo / "snapshots" / commit / "config.json"]
    elif (repo / "snapshots").is_dir():
        # No main ref (a download of another revision): the one snapshot there, if only one.
        found = sorted(p / "config.json" for p in list((repo / "snapshots").iterdir())[:64]
                       if (p / "config.json").is_file())
        if len(found) > 1:
            raise ValueError(f"{name}: the cache has {len(found)} snapshots of it and no main revision "
                             f"({repo / 'snapshots'}); give one snapshot's folder")
    if not found or not found[0].is_file():
        raise ValueError(f"{name}: the cache ({repo}) has no config.json for its main revision; " + _fetch_hint(name))
    return found[0]


def name_from_path(path) -> str:
    """The name a config.json's place gives its model (as the command's hf_name_from_path): the
    model's name in the cache (models--[org--]name/snapshots/<commit>/config.json: "name"), else
    the folder of a file called config.json, else the file's name without ".json"; printable
    ASCII only, at most 64 characters."""
    def clean(text: str) -> str:
        out = "".join(c for c in text if " " < c < "\x7f")[:64]
        return "" if out in (".", "..") else out

    p = Path(path)
    if p.name == "config.json":
        repo = p.parent.parent.parent.name
        if p.parent.parent.name == "snapshots" and repo.startswith("models--"):
            name = clean(repo[repo.rfind("--") + 2:])
            if name:
                return name
        if clean(p.parent.name):
            return clean(p.parent.name)
    name = p.name[:-5] if p.name.endswith(".json") and len(p.name) > 5 else p.name
    return clean(name)
