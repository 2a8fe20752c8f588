"""Where runs, checkpoints and data sets live: local folders, mounted (NFS) folders and object
stores (``s3://``, ``gs://``, ...), behind one interface built on pyarrow's filesystems, the layer
Ray Train itself writes checkpoints through.

Why not fsspec or Ray's own ``StorageContext``: pyarrow is already a dependency (Parquet), its
``FileSystem.from_uri`` reads the endpoint of an S3-compatible store from the URI's query
(``?endpoint_override=HOST:PORT&scheme=http``) and the usual ``AWS_*`` variables, and Ray's storage
context is internal API. What pyarrow lacks is kept here: joining paths under a URI that has a
query, and publishing a folder so that it is never seen half-written.

Invariants:
- A location is a local absolute path (``~`` expanded) or a URI that keeps its scheme and query, so
  every path this tool prints can be pasted back into any option.
- ``publish_folder`` makes a folder visible only when complete. Locally it is written beside its
  target and renamed (atomic). On object stores, which have no rename, every file is uploaded and
  ``COMPLETE_MARKER`` last; ``is_complete`` is what readers ask, so a folder torn by a crash during
  the upload is never picked (``latest_complete``).
- A bad location is one ``UsageError`` naming the option: an unknown scheme, a URI without a
  bucket, a store that refuses the request.
- Every local file and folder the tool writes (a run folder, a checkpoint, an evaluation, an
  export, a data set, a benchmark) gets the mode the user's umask gives an ordinary one
  (``ordinary_mode``: 0644 and 0755 under umask 022), also where it was written under a temporary
  name (``tempfile`` makes those 0600 and 0700, private) and renamed into place (``write_local``,
  ``local_replacement``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from raytrain_mp.errors import UsageError
from raytrain_mp.interruption import uninterrupted

COMPLETE_MARKER = ".complete"


def umask() -> int:
    """The process's umask, read without changing it where the kernel says it (Linux >= 4.7)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere the only way to read it is to set it, and set it back
    os.umask(mask)
    return mask


def ordinary_mode(folder: bool = False) -> int:
    """The mode ``open()`` or ``mkdir`` would give a new file (folder): 0o666 (0o777) less the umask."""
    return (0o777 if folder else 0o666) & ~umask()


def make_ordinary(path: str | Path) -> None:
    """Give ``path`` (a file, or a folder and everything in it) the ordinary mode (see the module doc):
    for what ``tempfile`` made private before it is renamed into place."""
    path = Path(path)
    if path.is_dir():
        for folder, _, files in os.walk(path):
            os.chmod(folder, ordinary_mode(folder=True))
            for name in files:
                os.chmod(os.path.join(folder, name), ordinary_mode())
    else:
        os.chmod(path, ordinary_mode())


@contextmanager
def local_replacement(path: str | Path, suffix: str = "") -> Iterator[Path]:
    """A temporary file beside the local file ``path`` to write ``path``'s new content into (its
    folder is made): when the block ends, the file gets the ordinary mode and replaces ``path`` at
    once (a rename); when it raises, the file is removed and ``path`` stays as it was. ``suffix``
    for writers that pick a format by the file's name."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=".tmp-", suffix=suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        make_ordinary(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_local(path: str | Path, data: bytes) -> None:
    """Write the local file ``path`` whole (``local_replacement``): never seen half-written."""
    with local_replacement(path) as tmp:
        tmp.write_bytes(data)


def is_uri(location: str) -> bool:
    return "://" in location


def split_query(uri: str) -> tuple[str, str]:
    """``("s3://b/runs", "?endpoint_override=...")`` of ``s3://b/runs?endpoint_override=...``."""
    base, sep, query = uri.partition("?")
    return base, sep + query


def join(location: str, *parts: str) -> str:
    """``location/part/...``, with a URI's query kept at the end."""
    base, query = split_query(location)
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)]) + query


def name_of(location: str) -> str:
    """The last path component (a checkpoint folder's name, say)."""
    return split_query(location)[0].rstrip("/").rsplit("/", 1)[-1]


@dataclass(frozen=True)
class Location:
    """A place in a filesystem: ``fs`` and ``path`` for pyarrow, ``uri`` for people."""

    fs: pafs.FileSystem
    path: str
    uri: str

    @property
    def is_local(self) -> bool:
        """A local or mounted folder: renames are atomic there, and nothing needs a marker."""
        return isinstance(self.fs, pafs.LocalFileSystem)

    def child(self, *parts: str) -> Location:
        return Location(self.fs, "/".join([self.path.rstrip("/"), *parts]), join(self.uri, *parts))

    def exists(self) -> bool:
        return self.fs.get_file_info(self.path).type != pafs.FileType.NotFound

    def is_file(self) -> bool:
        return self.fs.get_file_info(self.path).type == pafs.FileType.File

    def read_bytes(self) -> bytes:
        with self.fs.open_input_stream(self.path) as f:
            return f.read()

    def write_bytes(self, data: bytes) -> None:
        """Write one file (an object store's PUT is atomic; locally via a renamed temporary file),
        whole also under Ctrl-C (``interruption.uninterrupted``)."""
        with uninterrupted():
            if self.is_local:
                write_local(self.path, data)
                return
            with self.fs.open_output_stream(self.path) as f:
                f.write(data)

    def folders(self, prefix: str, order: Callable[[str], Any] | None = None) -> list[Location]:
        """The sub-folders whose names start with ``prefix``, by name (or by ``order`` of their names)."""
        if not self.exists():
            return []
        infos = self.fs.get_file_info(pafs.FileSelector(self.path, recursive=False))
        names = sorted(
            (i.base_name for i in infos if i.type == pafs.FileType.Directory and i.base_name.startswith(prefix)),
            key=order,
        )
        return [self.child(name) for name in names]


# Schemes pyarrow's FileSystem.from_uri opens, and those whose first path part is a bucket.
SCHEMES = ("file", "s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss")
BUCKET_SCHEMES = ("s3", "gs", "gcs", "abfs", "abfss")


def check_uri(location: str, option: str) -> None:
    """The syntax of a URI (known scheme, a bucket where one is needed), without asking any store:
    for ``validate()``, which must not touch the network (pyarrow looks up an S3 bucket's region)."""
    scheme, _, rest = location.partition("://")
    accepted = f"accepted: a local folder or a URI such as s3://BUCKET/PATH (schemes: {', '.join(SCHEMES)})"
    if scheme not in SCHEMES:
        raise UsageError(f"{option}: cannot use {location} (unknown scheme {scheme!r}); {accepted}")
    if scheme in BUCKET_SCHEMES and not split_query(rest)[0].split("/", 1)[0]:
        raise UsageError(f"{option}: cannot use {location} (no bucket name); {accepted}")


def locate(location: str, option: str) -> Location:
    """The ``Location`` of a local path or URI given to ``option``; a bad one is a UsageError."""
    if not is_uri(location):
        path = str(Path(location).expanduser().resolve())
        return Location(pafs.LocalFileSystem(), path, path)
    check_uri(location, option)
    try:
        fs, path = pafs.FileSystem.from_uri(location)  # on S3 without an endpoint: asks AWS for the bucket's region
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as exc:
        raise UsageError(
            f"{option}: cannot use {location} ({' '.join(str(exc).split())}); accepted: a URI pyarrow opens"
        ) from None
    except OSError as exc:
        raise UsageError(
            f"{option}: {location}: the store refused the request ({' '.join(str(exc).split())})"
        ) from None
    return Location(fs, path.rstrip("/") or path, split_query(location)[0].rstrip("/") + split_query(location)[1])


def check_reachable(location: Location, option: str) -> None:
    """Ask the store once (a listing of the bucket or folder), so a missing bucket or refused
    credentials stop the command before anything runs; local folders are checked elsewhere."""
    if location.is_local:
        return
    bucket = location.path.split("/", 1)[0]
    try:
        info = location.fs.get_file_info(bucket)
    except OSError as exc:
        raise UsageError(
            f"{option}: {location.uri}: the store refused the request ({' '.join(str(exc).split())})"
        ) from None
    if info.type == pafs.FileType.NotFound:
        raise UsageError(f"{option}: {location.uri}: no bucket {bucket!r}; create it first")


def is_complete(folder: Location) -> bool:
    """A published folder: locally any folder (publishing renames whole folders), on object stores
    only one whose marker was uploaded last."""
    if folder.is_local:
        return folder.exists()
    return folder.child(COMPLETE_MARKER).is_file()


def latest_complete(parent: Location, prefix: str, order: Callable[[str], Any] | None = None) -> Location | None:
    """The last (by name, or by ``order`` of the names) complete sub-folder of ``parent`` starting with ``prefix``."""
    complete = [folder for folder in parent.folders(prefix, order) if is_complete(folder)]
    return complete[-1] if complete else None


def publish_folder(local: Path, target: Location, last: str | None = None) -> None:
    """Make the finished local folder ``local`` visible as ``target``, all at once (see module doc).
    On object stores the file named ``last`` (a data set's metadata, say) is uploaded after all
    the others and serves as the marker; without one, an empty ``COMPLETE_MARKER`` is written
    last. ``local`` is consumed."""
    if target.is_local:
        Path(target.path).parent.mkdir(parents=True, exist_ok=True)
        make_ordinary(local)  # a tempfile.mkdtemp folder is private
        os.replace(local, target.path)
        return
    target.fs.create_dir(target.path, recursive=True)
    files = sorted((p for p in local.rglob("*") if p.is_file()), key=lambda p: (p.name == last, str(p)))
    for file in files:
        pafs.copy_files(
            str(file),
            target.child(*file.relative_to(local).parts).path,
            source_filesystem=pafs.LocalFileSystem(),
            destination_filesystem=target.fs,
        )
    if last is None:
        target.child(COMPLETE_MARKER).write_bytes(b"")
    shutil.rmtree(local)


def delete_folder(folder: Location, marker: str = COMPLETE_MARKER) -> None:
    """Remove a published folder; on object stores its marker goes first, so a half-deleted folder
    is already incomplete."""
    if not folder.is_local and folder.child(marker).is_file():
        folder.fs.delete_file(folder.child(marker).path)
    folder.fs.delete_dir(folder.path)


def download_folder(folder: Location, local: Path) -> Path:
    """Copy a folder (a checkpoint to load, say) into the local folder ``local``; returns it."""
    if folder.is_local:
        return Path(folder.path)
    for info in folder.fs.get_file_info(pafs.FileSelector(folder.path, recursive=True)):
        if info.type == pafs.FileType.File:
            target = local / info.path[len(folder.path) + 1 :]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(Location(folder.fs, info.path, "").read_bytes())
    return local
