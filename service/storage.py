"""Where a job's files live: its uploads, the pipeline's working directory, its artifacts.

``ArtifactStore`` is the interface the routes and the job process use; ``LocalArtifactStore``
keeps everything under the data directory. The pipeline writes into a per-attempt staging
directory; only a succeeded job's directory is renamed into place (with a manifest of every
file's size and sha256 written first), so a half-written artifact is never served, and only
names in that manifest are ever served (no path from a client reaches the file system).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import zipfile
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from quant.digest import sha256_file

if TYPE_CHECKING:
    from .settings import Settings

MANIFEST = ".manifest.json"


@dataclass(frozen=True)
class ArtifactInfo:
    name: str  # path relative to the job's output directory, "/"-separated
    bytes: int
    sha256: str


class ArtifactStore(ABC):
    """A job's files. A distributed deployment swaps in shared or object storage here."""

    @abstractmethod
    def upload_dir(self, job_id: str) -> Path:
        """The (created) directory a job's uploads are written to."""

    @abstractmethod
    def staging_dir(self, job_id: str, attempt: int) -> Path:
        """A fresh, empty directory for one run of the pipeline."""

    @abstractmethod
    def work_dir(self, job_id: str, attempt: int) -> Path:
        """The (created) directory one run's steps hand each other their files in (samples,
        the prepared record, each target's part): never published. In Celery mode every
        worker reaches it at the same path."""

    @abstractmethod
    def commit(self, job_id: str, staging: Path) -> list[ArtifactInfo]:
        """Publish a finished run's directory as the job's artifacts, atomically."""

    @abstractmethod
    def list(self, job_id: str) -> list[ArtifactInfo] | None:
        """The published artifacts, or None if the job has none."""

    @abstractmethod
    def path(self, job_id: str, name: str) -> Path | None:
        """The file of a published artifact, or None if no such artifact."""

    @abstractmethod
    def bundle(self, job_id: str) -> Path | None:
        """Every artifact (and the reports) in one new zip file, which the caller removes once
        sent; None if the job has no artifacts (any more)."""

    @abstractmethod
    def delete(self, job_id: str) -> None:
        """Remove everything of a job: uploads, staging, artifacts."""

    @abstractmethod
    def discard_run(self, job_id: str, attempt: int) -> None:
        """Remove what a run left in its staging and work directories."""

    @abstractmethod
    def delete_uploads(self, job_id: str) -> None:
        """Remove a job's uploads only (after it finished, or when an upload is refused)."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalArtifactStore(ArtifactStore):
    """``{root}/uploads/{job}/``, ``{root}/artifacts/.staging/{job}-{attempt}/`` (and its
    ``.work`` beside it) and ``{root}/artifacts/{job}/`` (staging shares the file system, so
    the rename is atomic); bundles being sent in ``{root}/tmp/``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()
        self.uploads = self.root / "uploads"
        self.artifacts = self.root / "artifacts"
        self.staging = self.artifacts / ".staging"
        self.scratch = self.root / "tmp"

    @staticmethod
    def _check_id(job_id: str) -> str:
        if not job_id.isalnum():  # ids are uuid hex; anything else is not ours
            raise ValueError(f"not a job id: {job_id!r}")
        return job_id

    def upload_dir(self, job_id: str) -> Path:
        path = self.uploads / self._check_id(job_id)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def staging_dir(self, job_id: str, attempt: int) -> Path:
        path = self.staging / f"{self._check_id(job_id)}-{attempt}"
        shutil.rmtree(path, ignore_errors=True)  # a crashed earlier try of this same attempt
        path.mkdir(parents=True)
        return path

    def work_dir(self, job_id: str, attempt: int) -> Path:
        path = self.staging / f"{self._check_id(job_id)}-{attempt}.work"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def commit(self, job_id: str, staging: Path) -> list[ArtifactInfo]:
        files = sorted(p for p in staging.rglob("*") if p.is_file() and p.name != MANIFEST)
        infos = [
            ArtifactInfo(p.relative_to(staging).as_posix(), p.stat().st_size, sha256_file(p))
            for p in files
        ]
        manifest = staging / MANIFEST
        manifest.write_text(json.dumps([asdict(i) for i in infos], indent=1))
        for path in [*files, manifest]:
            with path.open("rb") as stream:
                os.fsync(stream.fileno())
        final = self.artifacts / self._check_id(job_id)
        self.staging.mkdir(parents=True, exist_ok=True)
        if final.exists():  # a run that published but crashed before recording it
            old = self.staging / f"old-{job_id}-{uuid.uuid4().hex[:8]}"
            final.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        staging.rename(final)
        _fsync_dir(self.artifacts)
        return infos

    def list(self, job_id: str) -> list[ArtifactInfo] | None:
        manifest = self.artifacts / self._check_id(job_id) / MANIFEST
        try:
            return [ArtifactInfo(**entry) for entry in json.loads(manifest.read_text())]
        except FileNotFoundError:
            return None

    def path(self, job_id: str, name: str) -> Path | None:
        listed = {info.name for info in self.list(job_id) or []}
        return self.artifacts / job_id / name if name in listed else None

    def bundle(self, job_id: str) -> Path | None:
        infos = self.list(job_id)
        if infos is None:
            return None
        self.scratch.mkdir(parents=True, exist_ok=True)
        dest = self.scratch / f"bundle-{job_id}-{uuid.uuid4().hex}.zip"
        base = self.artifacts / job_id
        try:
            with zipfile.ZipFile(dest, "w", compression=zipfile.ZIP_DEFLATED) as bundle:
                for info in infos:
                    bundle.write(base / info.name, f"{job_id}/{info.name}")
        except FileNotFoundError:  # deleted while it was being zipped
            dest.unlink(missing_ok=True)
            return None
        return dest

    def delete(self, job_id: str) -> None:
        self._check_id(job_id)
        self.delete_uploads(job_id)
        for path in self.staging.glob(f"{job_id}-*"):
            shutil.rmtree(path, ignore_errors=True)
        final = self.artifacts / job_id
        self.staging.mkdir(parents=True, exist_ok=True)
        if final.exists():  # rename first: a reader never sees a half-deleted directory
            trash = self.staging / f"old-{job_id}-{uuid.uuid4().hex[:8]}"
            final.rename(trash)
            shutil.rmtree(trash, ignore_errors=True)

    def delete_uploads(self, job_id: str) -> None:
        shutil.rmtree(self.uploads / self._check_id(job_id), ignore_errors=True)

    def discard_run(self, job_id: str, attempt: int) -> None:
        run = f"{self._check_id(job_id)}-{attempt}"
        for name in (run, f"{run}.work"):
            shutil.rmtree(self.staging / name, ignore_errors=True)


def make_store(settings: Settings) -> ArtifactStore:
    """The artifact store the settings ask for (the local data directory: the one kind so far;
    shared or object storage would be chosen here)."""
    return LocalArtifactStore(settings.data_dir)
