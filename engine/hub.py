"""Hugging Face Hub model ids for `--model` / `LLM(model=...)` / JITKERN_MODEL, as vLLM takes them.

    resolve_model("Qwen/Qwen3-0.6B")                       # a snapshot folder in the HF cache
    resolve_model("unsloth/Qwen3-0.6B-GGUF:Qwen3-0.6B-Q4_K_M.gguf")   # one file of a GGUF repo
    resolve_model("unsloth/Qwen3-0.6B-GGUF:Q4_K_M")        # the same, by its quantisation tag
    resolve_model("unsloth/Qwen3-0.6B-GGUF/Qwen3-0.6B-Q4_K_M.gguf")   # the same, as a path-like id

A local path always wins: only a string that is no existing file or folder is taken as an id. The cache
is looked at first (no network); if the model is not there and HF_HUB_OFFLINE is not set, it is
downloaded (huggingface_hub's progress bars) into the usual cache (HF_HUB_CACHE / HF_HOME). Only the files
the loader reads are fetched: *.json, *.safetensors, tokenizer*, *.model and *.gguf (a repo with
safetensors skips its GGUF files; a GGUF repo with several files needs one named).

huggingface_hub is imported here only, when an id is resolved: reading local checkpoints never needs it.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from engine.errors import ModelLoadError

ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.gguf"]
_NO_GGUF = ["*.json", "*.safetensors", "tokenizer*", "*.model"]
# The Hub's repo-name rule: letters, digits, '-', '_', '.'; no '--' or '..'; '-' and '.' not at either end.
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_REPO_ID = re.compile(rf"{_NAME}/{_NAME}")
_FILE = re.compile(r"[^/\\:]+\.gguf", re.IGNORECASE)
_TAG = re.compile(r"[A-Za-z0-9_.-]+")


class HubModelError(ModelLoadError):
    """A model id that cannot be resolved (not cached while offline, unknown or gated repo, no network)."""

    def __init__(self, message: str, model: str):
        self.model = model
        super().__init__(message)


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_offline() -> bool:
    # Read from the environment on every call (huggingface_hub reads it once, at its import, which may have
    # happened before the caller set it).
    return _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(os.environ.get("TRANSFORMERS_OFFLINE"))


def _cache_dir() -> str | None:
    # Likewise: passed explicitly so that a HF_HUB_CACHE set after huggingface_hub's import still counts.
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    return None


def parse_model_id(model: str) -> tuple[str, str | None, str | None] | None:
    """(repo_id, gguf file name, quantisation tag) when `model` has the form of a hub id, else None."""
    if model.startswith(("/", "~", ".")) or "\\" in model:
        return None
    repo, sel = model, None
    if ":" in model:
        repo, sel = model.split(":", 1)
    elif model.count("/") == 2 and model.lower().endswith(".gguf"):
        repo, sel = model.rsplit("/", 1)
    if not _REPO_ID.fullmatch(repo) or "--" in repo or ".." in repo:
        return None
    if sel is None:
        return repo, None, None
    if _FILE.fullmatch(sel):
        return repo, sel, None
    if _TAG.fullmatch(sel):
        return repo, None, sel
    return None


def looks_like_hub_id(model: str) -> bool:
    return parse_model_id(model) is not None


def resolve_model(model: str | os.PathLike) -> str:
    """A local path as it is; a hub id as the cached (or just downloaded) folder or .gguf file.

    Raises HubModelError (a ModelLoadError) with one line naming the id when it cannot be had, and
    ModelLoadError "no such file or directory" for a string that is neither a path nor an id.
    """
    model = os.fspath(model)
    if os.path.exists(model):
        return model
    parsed = parse_model_id(model)
    if parsed is None:
        raise ModelLoadError(f"{model}: no such file or directory (nor a Hugging Face model id such as "
                             "Qwen/Qwen3-0.6B)")
    repo, filename, tag = parsed
    try:
        import huggingface_hub  # noqa: F401
    except ImportError:
        raise HubModelError(f"{model}: no such file or directory, and huggingface_hub (needed to fetch a Hugging "
                            "Face model id) is not installed: pip install huggingface_hub", model) from None
    path = _from_cache(model, repo, filename, tag)
    if path is not None:
        return path
    if hub_offline():
        where = _cache_dir() or "the Hugging Face cache"
        raise HubModelError(f"{model}: not in {where} and HF_HUB_OFFLINE is set; download it first "
                            f"(hf download {repo}) or unset HF_HUB_OFFLINE", model)
    return _download(model, repo, filename, tag)


def _snapshot(repo: str, patterns: list[str], *, local: bool) -> str:
    from huggingface_hub import snapshot_download
    return snapshot_download(repo, allow_patterns=patterns, local_files_only=local, cache_dir=_cache_dir())


def _pick_gguf(model: str, names: list[str], filename: str | None, tag: str | None) -> str | None:
    """The one .gguf file of `names` that `model` asks for (by name or tag, or the only one); None if none
    is there; HubModelError if the choice is ambiguous."""
    ggufs = sorted(n for n in names if n.lower().endswith(".gguf"))
    if filename is not None:
        return filename if filename in ggufs else None
    if tag is not None:
        hits = [n for n in ggufs if Path(n).stem.lower().endswith(tag.lower())
                and not Path(n).stem[:-len(tag)][-1:].isalnum()]
        if len(hits) > 1:
            raise HubModelError(f"{model}: {len(hits)} .gguf files match the tag {tag!r} ({', '.join(hits)}); "
                                f"name one as {model.split(':')[0]}:FILE.gguf", model)
        return hits[0] if hits else None
    if len(ggufs) > 1:
        shown = ", ".join(ggufs[:8]) + (", ..." if len(ggufs) > 8 else "")
        raise HubModelError(f"{model}: the repository holds {len(ggufs)} .gguf files ({shown}); pick one as "
                            f"{model}:FILE.gguf or {model}:QUANT (e.g. :Q4_K_M)", model)
    return ggufs[0] if ggufs else None


def _from_cache(model: str, repo: str, filename: str | None, tag: str | None) -> str | None:
    """The cached folder or file for `model`, or None when it is not (completely) in the cache."""
    # The patterns asked of the cache are those a download of this form fetched: a wider one (all *.gguf)
    # would count the GGUF files never fetched as missing once the hub's file list is cached.
    if filename is not None:
        patterns = [filename]
    elif tag is not None:
        patterns = sorted({f"*{t}.gguf" for t in (tag, tag.upper(), tag.lower())})
    else:
        patterns = _NO_GGUF
    try:
        folder = _snapshot(repo, patterns, local=True)
    except Exception:  # noqa: BLE001 - LocalEntryNotFoundError, IncompleteSnapshotError, ...: not cached
        return None
    if filename is None and tag is None and any(n.endswith(".safetensors") for n in os.listdir(folder)):
        return folder
    name = _pick_gguf(model, [str(p.relative_to(folder)) for p in Path(folder).rglob("*.gguf")], filename, tag)
    if name is None:
        return None
    return os.path.join(folder, name) if filename is not None or tag is not None else folder


def _hub_error(model: str, e: Exception) -> HubModelError:
    kind = type(e).__name__
    if kind in ("RepositoryNotFoundError", "RevisionNotFoundError"):
        why = "no such model on the Hugging Face Hub (or it is private: log in with `hf auth login` or set HF_TOKEN)"
    elif kind == "GatedRepoError":
        why = "the model is gated: accept its terms on huggingface.co and log in (`hf auth login` or HF_TOKEN)"
    else:
        first = (str(e).strip().splitlines() or [kind])[0]
        why = f"could not be downloaded from the Hugging Face Hub ({kind}: {first[:200]})"
    return HubModelError(f"{model}: {why}", model)


def _download(model: str, repo: str, filename: str | None, tag: str | None) -> str:
    from huggingface_hub import HfApi
    try:
        names = HfApi().list_repo_files(repo)
        if filename is not None or tag is not None:
            name = _pick_gguf(model, names, filename, tag)
            if name is None:
                raise HubModelError(f"{model}: the repository has no such .gguf file", model)
            patterns = [name]
        else:
            has_safetensors = any(n.endswith(".safetensors") for n in names)
            name = None if has_safetensors else _pick_gguf(model, names, None, None)
            if not has_safetensors and name is None:
                raise HubModelError(f"{model}: the repository has no .safetensors or .gguf weights", model)
            patterns = _NO_GGUF if has_safetensors else _NO_GGUF + [name]
        print(f"downloading {model} from the Hugging Face Hub ({', '.join(patterns)})", file=sys.stderr, flush=True)
        folder = _snapshot(repo, patterns, local=False)
    except HubModelError:
        raise
    except Exception as e:  # noqa: BLE001 - the hub's and the network's errors, each said in one line
        raise _hub_error(model, e) from None
    return os.path.join(folder, name) if name is not None and (filename or tag) else folder
