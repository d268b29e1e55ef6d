"""A snapshot's manifest: the BLAKE3 digest and size of every image file, and its one checksum.

``write_manifest`` writes ``IMAGES/manifest.json`` after a dump (digests
taken while CRIU wrote, by ``TailHasher``); ``read_manifest`` checks that
every file is present at its size; ``check_hashes`` / ``verify_manifest``
check the contents. ``checksum`` is the snapshot's one identity: the SHA-256
of its manifest (which holds every file's digest). tpassd returns it from a
dump and checks it at verify on the target.

Format 2 (what dumps write now) keeps each file's BLAKE3; format 1 (written by
earlier versions, and still read: a whole-job snapshot may be days old) its SHA-256.
Why BLAKE3: the digests are taken while every rank of the job stands still,
at the dump and again at the restore, and SHA-256 was the slower half of
both. Measured here (one core, AVX-512 and SHA-NI): SHA-256 1.65 GB/s,
BLAKE3 5.2 GB/s; CRIU dumps and restores at 1.5-2.8 GB/s. A 100M-parameter
rank's 2.2 GB image took CRIU 0.81 s to dump, and the dump 1.78 s with its
SHA-256 (docs/benchmark-history.md, "The images' digest and the source's kill").
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any, Callable

import blake3

from torchpass.checkpoint.safeio import MAX_MANIFEST_BYTES, read_regular
from torchpass.errors import CheckpointError

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 2
# manifest format -> (the files' digest key, its name in errors, a new hash object)
DIGESTS: dict[int, tuple[str, str, Callable[[], Any]]] = {
    1: ("sha256", "SHA-256", hashlib.sha256),
    2: ("blake3", "BLAKE3", blake3.blake3),
}
_LOG_SUFFIX = ".log"


def _digest(path: Path, fmt: int = MANIFEST_FORMAT) -> str:
    h = DIGESTS[fmt][2]()
    with open(path, "rb") as f:
        while chunk := f.read(4 << 20):
            h.update(chunk)
    return h.hexdigest()


def _image_files(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.is_file() and p.name != MANIFEST and not p.name.endswith(_LOG_SUFFIX))


class TailHasher:
    """The digest (BLAKE3) of the image files of a directory, computed while CRIU writes them.

    CRIU writes every image file once, front to back (a fresh directory per
    dump). A thread follows each file's end and hashes what has been
    written so far; when CRIU has exited, ``finish`` hashes the rest. The
    dump then costs max(CRIU, hashing), not their sum (measured at 10M
    parameters: CRIU 0.40 s + a separate SHA-256 pass 0.39 s over 440 MB,
    while every rank of the job stood still). The hash releases the GIL. Only files of at least
    ``min_bytes`` are followed (the pages); the small ones are hashed at the
    end. If a file were ever rewritten in place the digest would not match
    its content, and the restore side's check refuses the snapshot: the
    failure is safe (a rollback), never a corrupt rank.
    """

    def __init__(self, d: str | os.PathLike, *, min_bytes: int = 1 << 20, chunk: int = 4 << 20):
        self.d = Path(d)
        self.min_bytes = min_bytes
        self.chunk = chunk
        self._files: dict[str, tuple] = {}  # name -> (file object, hash, bytes hashed)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tail-hasher", daemon=True)

    def __enter__(self) -> "TailHasher":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for f, _h, _n in self._files.values():
            f.close()

    def _pass(self) -> None:
        for p in _image_files(self.d):
            ent = self._files.get(p.name)
            if ent is None:
                try:
                    if p.stat().st_size < self.min_bytes:
                        continue
                    ent = (open(p, "rb"), DIGESTS[MANIFEST_FORMAT][2](), 0)
                except OSError:
                    continue
                self._files[p.name] = ent
            f, h, n = ent
            while chunk := f.read(self.chunk):
                h.update(chunk)
                n += len(chunk)
            self._files[p.name] = (f, h, n)

    def _run(self) -> None:
        try:
            while not self._stop.wait(0.005):
                self._pass()
        except BaseException as exc:  # noqa: BLE001 - reported by finish(); the manifest then hashes afresh
            self._error = exc

    def finish(self) -> dict[str, tuple[int, str]]:
        """Stop following; hash what is left. {name: (bytes hashed, digest hex)}."""
        self._stop.set()
        self._thread.join()
        if self._error is not None:
            return {}
        self._pass()
        return {name: (n, h.hexdigest()) for name, (_f, h, n) in self._files.items()}


def write_manifest(d: str | os.PathLike, meta: dict | None = None,
                   hashed: dict[str, tuple[int, str]] | None = None) -> dict:
    """Checksum every image file of ``d`` into d/manifest.json (files 0600).

    ``hashed``: digests already computed (TailHasher), used for a file whose
    size is exactly the number of bytes they covered.
    """
    d = Path(d)
    key = DIGESTS[MANIFEST_FORMAT][0]
    files = {}
    for p in _image_files(d):
        os.chmod(p, 0o600)
        size = p.stat().st_size
        known = (hashed or {}).get(p.name)
        files[p.name] = {"size": size, key: known[1] if known and known[0] == size else _digest(p)}
    if not files:
        raise CheckpointError(f"snapshot {d} holds no image files")
    manifest = {"format": MANIFEST_FORMAT, "files": files, "meta": meta or {}}
    tmp = d / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.chmod(tmp, 0o600)
    os.replace(tmp, d / MANIFEST)
    return manifest


def verify_manifest(d: str | os.PathLike) -> dict:
    """Check every image file against the manifest; CheckpointError naming the first problem."""
    manifest = read_manifest(d)
    check_hashes(d, manifest)
    return manifest


def check_hashes(d: str | os.PathLike, manifest: dict) -> None:
    """The digest of every image file against ``manifest`` (from read_manifest: a known format)."""
    d = Path(d)
    fmt = manifest["format"]
    key, label = DIGESTS[fmt][:2]
    for name, want in sorted(manifest["files"].items()):
        if _digest(d / name, fmt) != want.get(key):
            raise CheckpointError(f"snapshot {d} is corrupt: {name} fails its {label} check; take a new snapshot")


def read_manifest(d: str | os.PathLike) -> dict:
    """The manifest, with every image file present at its size (contents not hashed:
    check_hashes, or restore(checked=...) which hashes while CRIU restores)."""
    d = Path(d)
    try:
        manifest = json.loads(read_manifest_bytes(d))
    except FileNotFoundError:
        raise CheckpointError(f"snapshot {d} has no {MANIFEST}: it is incomplete (the dump did not finish); "
                              "take a new snapshot") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"snapshot {d}: {MANIFEST} is unreadable ({exc}); take a new snapshot") from None
    fmt = manifest.get("format") if isinstance(manifest, dict) else None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if type(fmt) is not int or fmt not in DIGESTS or not isinstance(files, dict) or not files:
        raise CheckpointError(f"snapshot {d}: {MANIFEST} is not a torchpass manifest (format {fmt!r}; this "
                              f"tpassd reads formats {', '.join(map(str, DIGESTS))}); take a new snapshot")
    for name, want in sorted(files.items()):
        if not isinstance(want, dict) or not isinstance(want.get(DIGESTS[fmt][0]), str):
            raise CheckpointError(f"snapshot {d}: {MANIFEST} gives no {DIGESTS[fmt][1]} digest for {name}; "
                                  "take a new snapshot")
        p = d / name
        if "/" in name or not p.is_file():
            raise CheckpointError(f"snapshot {d} is corrupt: image file {name} is missing; take a new snapshot")
        size = p.stat().st_size
        if size != want.get("size"):
            raise CheckpointError(f"snapshot {d} is corrupt: {name} has {size} bytes, the manifest says "
                                  f"{want.get('size')}; take a new snapshot")
    return manifest


def read_manifest_bytes(images: str | os.PathLike, *, dir_fd: int | None = None) -> bytes:
    """IMAGES/manifest.json as bytes: a regular file (not a symlink, FIFO or device) of at most
    safeio.MAX_MANIFEST_BYTES, else OSError at once. ``dir_fd``: IMAGES already opened."""
    if dir_fd is not None:
        return read_regular(MANIFEST, MAX_MANIFEST_BYTES, dir_fd=dir_fd)
    return read_regular(Path(images) / MANIFEST, MAX_MANIFEST_BYTES)


def checksum(images: str | os.PathLike, *, dir_fd: int | None = None) -> str:
    """The snapshot's checksum: SHA-256 of IMAGES/manifest.json (which holds every image file's digest)."""
    return checksum_of(read_manifest_bytes(images, dir_fd=dir_fd))


def checksum_of(manifest_bytes: bytes) -> str:
    """``checksum`` of a manifest already read."""
    return hashlib.sha256(manifest_bytes).hexdigest()


__all__ = ["MANIFEST", "MANIFEST_FORMAT", "TailHasher", "write_manifest", "read_manifest", "check_hashes",
           "verify_manifest", "read_manifest_bytes", "checksum", "checksum_of"]
