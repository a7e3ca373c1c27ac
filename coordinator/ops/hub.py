"""Checkpoints from the Hugging Face Hub: a repository id read from the local cache, and `shoal
pull` downloading one with huggingface_hub; the one place that reaches a hub (every other
command runs with HF_HUB_OFFLINE)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from engine.errors import InvalidInput, NotFound, ShoalError, Unavailable

# What a checkpoint needs for Shoal: config, tokenizer, chat template, safetensors weights.
# Not the other formats some repositories carry beside them (original/*.pth, *.bin, *.gguf).
CHECKPOINT_FILES = ("*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja",
                    "*.py")
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def is_repo_id(text: str) -> bool:
    """ORG/NAME, as the Hub spells repositories (not a path: no ./, ~ or a third part)."""
    return bool(_REPO_ID.fullmatch(text)) and not text.startswith(".")


def cache_dir() -> Path:
    """The Hugging Face cache huggingface_hub uses ($HF_HUB_CACHE, $HF_HOME/hub, ...)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def cache_entry(repo_id: str) -> Path:
    return cache_dir() / f"models--{repo_id.replace('/', '--')}"


def local_model(text: str) -> Path:
    """MODEL as `shoal shard` takes it: a folder (or cache entry) as given, else a repository
    id found in the Hugging Face cache. A repository not there is named with the command that
    fetches it, since Shoal reads only local files."""
    path = Path(text).expanduser()
    if path.exists() or not is_repo_id(text):
        return path
    entry = cache_entry(text)
    if (entry / "snapshots").is_dir():
        return entry
    raise NotFound(
        f"{text} is not a folder here, nor in the Hugging Face cache ({cache_dir()}). Shoal "
        f"reads local folders and that cache: download it with `shoal pull {text}` (or "
        f"`hf download {text}`), then run this again"
    )


def pull(repo_id: str, *, revision: str | None = None, progress: bool = True) -> Path:
    """Download a repository's checkpoint files into the Hugging Face cache; the snapshot
    folder. Files already there are not fetched again; a connection dropped mid-file resumes
    from the bytes received (huggingface_hub asks for the rest), while a file cut short by
    stopping the process starts over next time (huggingface_hub keeps no partial file)."""
    if not is_repo_id(repo_id):
        raise InvalidInput(f"{repo_id!r} is not a repository id like ORG/NAME")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import disable_progress_bars

    if not progress:
        disable_progress_bars()
    where = constants.ENDPOINT
    try:
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=CHECKPOINT_FILES)
    except GatedRepoError:
        raise ShoalError(f"{repo_id} is gated: accept its terms on {where}/{repo_id}, then "
                         "log in with `hf auth login` (or set HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise NotFound(f"no repository {repo_id} on {where} (or it is private: log in with "
                       "`hf auth login`, or set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise NotFound(f"{repo_id} has no revision {revision!r}") from None
    except LocalEntryNotFoundError:
        offline = constants.HF_HUB_OFFLINE
        why = ("HF_HUB_OFFLINE is set" if offline else f"{where} cannot be reached")
        raise Unavailable(
            f"cannot download {repo_id}: {why}, and the Hugging Face cache ({cache_dir()}) "
            "does not hold it complete. Run this again where the network reaches the Hub "
            "(files already fetched are kept; the rest resume), or copy the model folder "
            "here and give its path to `shoal shard`"
        ) from None
    except HfHubHTTPError as e:
        raise Unavailable(f"downloading {repo_id} from {where} failed: {e}") from None
    except OSError as e:
        raise ShoalError(f"downloading {repo_id} failed: {e}; run this again for the rest "
                         "(files already fetched are kept)") from None
    return Path(folder)


def hub_may_be_reached(command: str) -> None:
    """Every command but `shoal pull` works offline: keep libraries from reaching a hub."""
    if command != "pull":
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
