"""Prepared data on the Hugging Face Hub: `data.prepared = "hf://OWNER/NAME[@REVISION]"` names a
dataset repo holding what `anchormesh data prepare` wrote (manifest.json and the shard files at
its root).

Why pinned: a branch moves. The bootstrap resolves the revision to a commit once (and keeps it
across its restarts); every stage-0 peer downloads that commit's files, so all read the same
bytes, and each shard is still checked against the manifest's size and hash before it is used.
Why huggingface_hub: the hub's own client follows its redirects and storage backends and reads
HF_TOKEN (a private repo) and HF_ENDPOINT (a mirror) on each machine.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from peer.dataset.manifest import MANIFEST, Manifest, ShardError, ShardInfo, parse_manifest
from peer.dataset.shards import Windows
from peer.errors import ConfigError

PREFIX = "hf://"
REPO_TYPE = "dataset"
_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,199}")
COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class HubRef:
    """A dataset repo and a revision (a branch, a tag or a commit)."""

    repo: str
    revision: str = "main"

    @property
    def pinned(self) -> bool:
        return COMMIT.fullmatch(self.revision) is not None

    def __str__(self) -> str:
        return f"{PREFIX}{self.repo}@{self.revision}"


def is_hub(value: str) -> bool:
    return value.startswith(PREFIX)


def parse_hub(value: str, key: str = "data.prepared") -> HubRef:
    """`hf://OWNER/NAME[@REVISION]` as a HubRef; ConfigError saying what is wrong otherwise."""
    body = value[len(PREFIX) :] if is_hub(value) else value
    repo, _, revision = body.partition("@")
    if not _REPO.fullmatch(repo) or ".." in repo:
        raise ConfigError(
            key,
            value,
            "must be hf://OWNER/NAME[@REVISION]: a Hugging Face dataset repo id, e.g. hf://my-org/my-run-data@main",
        )
    if "@" in body and (not _REVISION.fullmatch(revision) or ".." in revision):
        raise ConfigError(key, value, "its @REVISION must be a branch, tag or commit of the repo")
    return HubRef(repo, revision or "main")


def parse_pinned(value: str) -> HubRef:
    """The tracker's `OWNER/NAME@COMMIT`: a ref at a full commit sha, nothing else."""
    ref = parse_hub(value, "the tracker's data_hub")
    if not ref.pinned:
        raise ConfigError("the tracker's data_hub", value, "must name a commit (40 hex digits)")
    return ref


def _quiet_bar() -> type:
    """A progress bar that draws nothing: a peer's log is not a terminal, and it logs what it fetches."""
    from huggingface_hub.utils.tqdm import tqdm

    class Quiet(tqdm):
        def __init__(self, *args, **kwargs) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Quiet


def _reason(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__


class HubData:
    """The bootstrap's view of prepared data on the hub: the manifest at the pinned commit, enough to
    count and order the windows. The bootstrap never downloads a shard; peers do."""

    def __init__(self, ref: HubRef, manifest: Manifest) -> None:
        self.ref, self.manifest = ref, manifest
        self.folder = str(ref)  # what messages call the data
        self.hub = f"{ref.repo}@{ref.revision}"  # what the tracker hands stage-0 peers
        self.dtype = np.dtype("<u2" if manifest.dtype == "uint16" else "<u4")

    def windows(self, seq_len: int, split: str = "train") -> Windows:
        return Windows(self, split, seq_len)  # type: ignore[arg-type]  # counts only: no token is read

    def tokens(self, shard: ShardInfo) -> np.ndarray:
        raise ShardError(shard.name, f"is on the hub ({self.ref}): the bootstrap does not download shards")


def pin(ref: HubRef) -> tuple[HubRef, bytes]:
    """(`ref` at the commit its revision names now, the manifest.json bytes at that commit).
    ConfigError when the repo, the revision or its manifest cannot be had."""
    import httpx2
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.errors import RemoteEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        meta = get_hf_file_metadata(
            hf_hub_url(ref.repo, MANIFEST, repo_type=REPO_TYPE, revision=ref.revision), retry_on_errors=True
        )
        commit = meta.commit_hash or ""
        if not COMMIT.fullmatch(commit):
            raise ConfigError(
                "data.prepared",
                str(ref),
                f"the hub named no commit for it (got {commit[:60]!r}): is HF_ENDPOINT a Hugging Face hub?",
            )
        pinned = HubRef(ref.repo, commit)
        with tempfile.TemporaryDirectory(prefix="anchormesh-hub-") as tmp:
            text = Path(
                hf_hub_download(
                    ref.repo, MANIFEST, repo_type=REPO_TYPE, revision=commit, local_dir=tmp, tqdm_class=_quiet_bar()
                )
            ).read_bytes()
    except RepositoryNotFoundError:
        raise ConfigError(
            "data.prepared", str(ref), "no such dataset repo on the hub (a private one needs HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise ConfigError("data.prepared", str(ref), f"the repo has no revision {ref.revision!r}") from None
    except RemoteEntryNotFoundError:
        raise ConfigError(
            "data.prepared",
            str(ref),
            f"holds no {MANIFEST} at its root: upload the folder `anchormesh data prepare` wrote",
        ) from None
    except (OSError, httpx2.HTTPError) as exc:
        raise ConfigError("data.prepared", str(ref), f"cannot read it from the hub: {_reason(exc)}") from None
    return pinned, text


def open_hub_data(ref: HubRef, tokenizer: str | None, pin_file: Path | None = None) -> HubData:
    """The run's data on the hub, pinned: the commit saved in `pin_file` (a restart of the run) when
    it names this repo and revision, else the commit the revision names now (then saved there)."""
    from peer.dataset.shards import check_tokenizer

    pinned = None
    if pin_file is not None and pin_file.is_file():
        saved_ref, _, commit = pin_file.read_text().strip().partition(" ")
        if saved_ref == str(ref) and COMMIT.fullmatch(commit):
            pinned = HubRef(ref.repo, commit)
    if ref.pinned:
        pinned = ref
    pinned, text = pin(pinned or ref)
    manifest = parse_manifest(text, f"{ref}/{MANIFEST}")
    check_tokenizer(manifest, tokenizer, str(pinned))
    if pin_file is not None:
        pin_file.parent.mkdir(parents=True, exist_ok=True)
        pin_file.write_text(f"{ref} {pinned.revision}\n")
    return HubData(pinned, manifest)


class HubSource:
    """Shards from a dataset repo at a pinned commit. A file the hub says is another size than the
    manifest's is refused before a byte of it is downloaded; one the repo lacks is refused too."""

    def __init__(self, ref: HubRef, staging: Path) -> None:
        if not ref.pinned:
            raise ConfigError("data hub", str(ref), "peers download from a pinned commit only")
        self.ref, self.staging = ref, Path(staging)
        self.where = f"the hub ({ref})"

    def download(self, name: str, size: int, part: Path) -> None:
        import httpx2
        from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
        from huggingface_hub.errors import RemoteEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

        self.staging.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(
            prefix=".hub-", dir=self.staging
        )  # hf_hub_download's own files (metadata, partial download) go with it
        try:
            meta = get_hf_file_metadata(
                hf_hub_url(self.ref.repo, name, repo_type=REPO_TYPE, revision=self.ref.revision)
            )  # no retries here: the prefetch tries again
            if meta.size is not None and meta.size != size:
                raise ShardError(name, f"{self.where} says {meta.size} bytes, the manifest says {size}")
            path = hf_hub_download(
                self.ref.repo,
                name,
                repo_type=REPO_TYPE,
                revision=self.ref.revision,
                local_dir=tmp,
                tqdm_class=_quiet_bar(),
            )
            os.replace(path, part)
        except (RemoteEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError) as exc:
            raise ShardError(name, f"{self.where} cannot give it: {_reason(exc)}") from None
        except httpx2.HTTPError as exc:  # the network: try again later
            raise OSError(f"{self.where}: {_reason(exc)}") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
