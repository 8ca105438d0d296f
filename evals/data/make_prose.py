"""Rebuild ``botchan.txt.gz`` from the copy of the book in the sentencepiece sdist.

The public-domain English translation of *Botchan* (Natsume Soseki, translated by
Yasotaro Morri, 1919) ships as ``test/botchan.txt`` inside the ``sentencepiece``
source distribution on PyPI. This script strips the distributor's header and
trailing license, re-joins hard-wrapped lines into paragraphs and writes the
result gzipped next to itself. Run it once by hand; nothing calls it at run time::

    pip download --no-deps --no-binary :all: sentencepiece==0.2.3 -d /tmp/sp
    python evals/data/make_prose.py /tmp/sp/sentencepiece-0.2.3.tar.gz
"""

from __future__ import annotations

import gzip
import re
import sys
import tarfile
from pathlib import Path

BOOK_START = "BOTCHAN (MASTER DARLING)"
BOOK_END = "--(THE END)--"
# Hard-wrapped lines run to ~70 characters; a shorter line that ends a sentence
# is the last line of its paragraph (the file lost its blank lines).
SHORT_LINE = 60


def read_raw(source: str) -> str:
    """Read the book from a sentencepiece sdist (``.tar.gz``) or a plain text file."""
    if source.endswith((".tar.gz", ".tgz")):
        with tarfile.open(source) as archive:
            member = next(m for m in archive.getmembers() if m.name.endswith("test/botchan.txt"))
            return archive.extractfile(member).read().decode("utf-8-sig")
    return Path(source).read_text(encoding="utf-8-sig")


def clean(raw: str) -> str:
    """Keep the translator's note and the novel, re-flowed into paragraphs."""
    lines = raw.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == BOOK_START)
    end = next(i for i, line in enumerate(lines) if line.strip() == BOOK_END) + 1
    paragraphs: list[str] = []
    current: list[str] = []
    for line in lines[start:end]:
        # "[A]" marks point at the transcriber's notes, which are dropped.
        line = re.sub(r"\[[A-Z]\]", "", line).strip()
        if not line:
            continue
        current.append(line)
        heading = line.isupper() or re.fullmatch(r"CHAPTER [IVXL]+\.?", line) is not None
        if heading or (len(line) < SHORT_LINE and re.search(r"[.!?\"']$", line)):
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return "\n\n".join(paragraphs) + "\n"


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise SystemExit(__doc__)
    text = clean(read_raw(argv[1]))
    out = Path(__file__).with_name("botchan.txt.gz")
    # mtime=0 keeps the archive byte-identical across rebuilds.
    with gzip.GzipFile(out, "wb", mtime=0) as handle:
        handle.write(text.encode("utf-8"))
    print(f"wrote {out} ({len(text)} characters, {text.count(chr(10) * 2) + 1} paragraphs)")


if __name__ == "__main__":
    main(sys.argv)
