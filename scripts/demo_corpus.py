"""The corpus of the shipped demo pair: text every Python install carries.

The documentation in ``pydoc_data.topics`` and the standard library's own ``.py`` sources, in a
fixed order, split by a hash of each document's name into training and held-out texts. Standard
library only: ``scripts/train_demo_models.py`` trains on it and ``scripts/convert_demo_models.py``
draws its held-out prompts from it.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

HELDOUT_MODULUS = 20  # a document is held out when md5(name) % 20 == 0, about 5%


def is_heldout(name: str) -> bool:
    """Whether a document belongs to the held-out split.

    The rule hashes the document's name, so it does not depend on which other files a given
    Python version has.

    Args:
        name (str): the document name, e.g. ``"stdlib/json/decoder.py"``.

    Returns:
        bool: ``True`` for about one document in ``HELDOUT_MODULUS``.
    """
    return int(hashlib.md5(name.encode()).hexdigest(), 16) % HELDOUT_MODULUS == 0


def iter_documents() -> Iterator[tuple[str, str]]:
    """Yield ``(name, text)`` for every corpus document in a fixed order.

    First the ``pydoc_data.topics`` entries (sorted by topic), then every ``.py`` file of the
    standard library (sorted by relative path; site-packages, dist-packages and caches are
    skipped, as are files that are not UTF-8). A text already yielded under another name is
    skipped, so no text is in both splits.

    Yields:
        tuple[str, str]: the document name and its text.
    """
    import pydoc_data.topics

    docs = ((f"pydoc/{k}", pydoc_data.topics.topics[k]) for k in sorted(pydoc_data.topics.topics))
    seen: set[str] = set()
    for name, text in itertools.chain(docs, _stdlib_sources()):
        digest = hashlib.md5(text.encode()).hexdigest()
        if digest not in seen:
            seen.add(digest)
            yield name, text


def _stdlib_sources() -> Iterator[tuple[str, str]]:
    """Yield ``(name, text)`` for the standard library's ``.py`` files, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]
        paths += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    for path in sorted(paths, key=lambda p: p.relative_to(root).as_posix()):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            yield f"stdlib/{path.relative_to(root).as_posix()}", text


def build_corpus(
    max_train_bytes: int | None = None, max_heldout_bytes: int | None = None
) -> tuple[list[str], list[str]]:
    """Split the corpus into training and held-out texts.

    Args:
        max_train_bytes (int, optional): stop adding training documents past this many UTF-8
            bytes. Default: no limit.
        max_heldout_bytes (int, optional): the same for held-out documents. Default: no limit.

    Returns:
        tuple[list[str], list[str]]: training texts and held-out texts, in corpus order.
    """
    train: list[str] = []
    heldout: list[str] = []
    sizes = {"train": 0, "heldout": 0}
    for name, text in iter_documents():
        split, docs, cap = (
            ("heldout", heldout, max_heldout_bytes)
            if is_heldout(name)
            else ("train", train, max_train_bytes)
        )
        if cap is not None and sizes[split] >= cap:
            continue
        docs.append(text)
        sizes[split] += len(text.encode())
    return train, heldout
