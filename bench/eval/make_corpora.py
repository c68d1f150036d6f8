#!/usr/bin/env python3
"""Builds the plain-text corpora that kvq-eval measures perplexity on.

Every text comes from a Debian package, so the corpora are real, public-domain
or freely licensed texts that any machine with Debian's archive can rebuild
byte for byte:

  kjv          eval   the King James Bible (package bible-kjv-text), dumped
                      with the `bible` reader of package bible-kjv: one chapter
                      heading per chapter, one verse per line.
  jargon       eval   the Jargon File 4.4.7 (package jargon-text): the prose of
                      the introduction, the lexicon and the appendices, with the
                      tables of contents and box-drawn tables left out and the
                      hard-wrapped paragraphs joined.
  austen       eval   five Jane Austen novels (package r-cran-janeaustenr),
                      read straight from the R lazy-load database in the .deb,
                      so no R is needed.
  code         eval   the C++ sources of the googletest and googlemock
                      libraries (package googletest, under /usr/src).
  calibration  calib. Northanger Abbey, the sixth Austen novel: a text that
                      appears in no evaluation corpus.

Output: OUT_DIR/<name>.txt (UTF-8, "\\n" newlines, ending in one newline) and
OUT_DIR/MANIFEST.json describing each file. The output depends only on the
packages' contents: file lists are sorted, nothing records a time or a path of
this machine beyond the packages' own installed paths.

Usage: make_corpora.py --out-dir DIR [--austen-deb PATH]
"""

from __future__ import annotations

import argparse
import bz2
import gzip
import hashlib
import io
import json
import lzma
import os
import re
import struct
import subprocess
import sys
import tarfile
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

JARGON_GZ = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
BIBLE_DATA = Path("/usr/lib/bible.data")
GTEST_ROOT = Path("/usr/src/googletest")
# The library proper (not its tests or samples): real, idiomatic C++ headers
# and sources, about 1.5 MB.
GTEST_DIRS = ("googletest/include", "googletest/src",
              "googlemock/include", "googlemock/src")
JANEAUSTENR_DATA = "usr/lib/R/site-library/janeaustenr/data"

# janeaustenr object name -> title. The first five are evaluated, the last is
# the calibration text.
AUSTEN_EVAL = (("sensesensibility", "Sense and Sensibility"),
               ("prideprejudice", "Pride and Prejudice"),
               ("mansfieldpark", "Mansfield Park"),
               ("emma", "Emma"),
               ("persuasion", "Persuasion"))
AUSTEN_CALIBRATION = (("northangerabbey", "Northanger Abbey"),)

# A corpus shorter than this cannot give several 8192-token windows
# (about 40 KB of English per window).
MIN_BYTES = 200_000


@dataclass
class Corpus:
    """One output text and where it came from."""

    name: str
    role: str  # "eval" or "calibration"
    package: str
    version: str
    sources: list[str]
    text: str = ""
    notes: str = ""
    extra: dict = field(default_factory=dict)


# --------------------------------------------------------------------------
# Helpers


def run(cmd: list[str], stdin: bytes | None = None) -> bytes:
    """Runs a command and returns its stdout; fails with its stderr."""
    proc = subprocess.run(cmd, input=stdin if stdin is not None else b"",
                          capture_output=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): "
                           f"{proc.stderr.decode(errors='replace').strip()}")
    return proc.stdout


def installed_version(package: str) -> str:
    """Version of an installed Debian package; fails if it is not installed."""
    out = run(["dpkg-query", "-W", "-f=${Status}\t${Version}", package])
    status, _, version = out.decode().partition("\t")
    if not status.endswith("installed") or not version:
        raise RuntimeError(f"Debian package {package} is not installed")
    return version


def owning_package(path: Path) -> str:
    """The Debian package that installed a path (dpkg -S)."""
    out = run(["dpkg", "-S", str(path)]).decode()
    return out.split(":", 1)[0].strip()


def normalize(text: str) -> str:
    """Unix newlines, no trailing blanks, at most one empty line in a row,
    exactly one final newline: the same bytes whatever the source layout."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\ufeff", "")
    lines = [line.rstrip() for line in text.split("\n")]
    out: list[str] = []
    for line in lines:
        if not line and (not out or not out[-1]):
            continue
        out.append(line)
    while out and not out[-1]:
        out.pop()
    return "\n".join(out) + "\n"


def join_paragraph(lines: list[str]) -> str:
    """Joins hard-wrapped lines of one paragraph into one line."""
    return " ".join(line.strip() for line in lines if line.strip())


# --------------------------------------------------------------------------
# King James Bible


# Verses are indented ("  1 In the beginning"); chapter headings, which may
# start with a digit ("1 Samuel 3"), are not.
VERSE_RE = re.compile(r"^\s+(\d+) (.*)$")


def make_kjv() -> Corpus:
    """Dumps the whole Bible with the `bible` program, one verse a line.

    bible.data is a compressed random-access format; the reader is the
    authoritative decoder. Pretty-printing (the default) gives full book names
    and chapter headings; a huge line width keeps every verse on one line.
    """
    raw = run(["bible", "-l100000", "Gen1:1-Rev22:21"]).decode("utf-8")
    out: list[str] = []
    verses = 0
    chapters = 0
    for line in raw.split("\n"):
        if not line.strip():
            continue
        m = VERSE_RE.match(line)
        if m:
            out.append(m.group(2).strip())
            verses += 1
        else:
            # A chapter heading such as "Genesis 1": a blank line around it.
            out.extend(["", line.strip(), ""])
            chapters += 1
    # The KJV has 1189 chapters and 31102 verses: a check that the dump is
    # complete and the parsing right.
    if chapters != 1189 or verses != 31102:
        raise RuntimeError(f"bible dump: {chapters} chapters, {verses} verses;"
                           " expected 1189 and 31102")
    return Corpus("kjv", "eval", "bible-kjv-text",
                  installed_version("bible-kjv-text"), [str(BIBLE_DATA)],
                  normalize("\n".join(out)),
                  notes=f"dumped with bible(1) of bible-kjv "
                        f"{installed_version('bible-kjv')}; chapter headings, "
                        "one verse per line, verse numbers dropped",
                  extra={"chapters": chapters, "verses": verses})


# --------------------------------------------------------------------------
# Jargon File

BOX_CHARS = re.compile("[\u2500-\u257f]")


def make_jargon() -> Corpus:
    """The Jargon File's running text, tables of contents left out.

    The text version lists every headword twice before the entries (a
    "framed" glossary and a per-letter index): runs of one-line paragraphs.
    Those runs, the box-drawn revision table and rule lines are dropped;
    paragraphs at the base indent are joined into one line, while indented
    blocks (examples, verse, code) keep their lines and relative indent.
    """
    text = gzip.decompress(JARGON_GZ.read_bytes()).decode("utf-8")
    text = text.replace("\r\n", "\n")
    lines = text.split("\n")
    # The body starts at the welcome page, after the front table of contents.
    start = next(i for i, line in enumerate(lines)
                 if line.strip() == "Welcome to the Jargon File"
                 and line.startswith("      "))
    paragraphs: list[list[str]] = []
    current: list[str] = []
    for line in lines[start:]:
        if line.strip():
            current.append(line.rstrip())
        elif current:
            paragraphs.append(current)
            current = []
    if current:
        paragraphs.append(current)

    # Drop runs of 4 or more consecutive one-line paragraphs: index lists.
    # Entry headings (":foo: n.") are one-line paragraphs too, but each one is
    # followed by its multi-line definition.
    keep = [True] * len(paragraphs)
    i = 0
    while i < len(paragraphs):
        j = i
        while j < len(paragraphs) and len(paragraphs[j]) == 1:
            j += 1
        if j - i >= 4:
            for k in range(i, j):
                keep[k] = False
        i = max(j, i + 1)

    out: list[str] = []
    for para, kept in zip(paragraphs, keep):
        if not kept:
            continue
        if any(BOX_CHARS.search(line) or set(line.strip()) <= {"\u2550"}
               for line in para):
            continue
        indents = [len(line) - len(line.lstrip(" ")) for line in para]
        base = 3  # The text version indents body text by three spaces.
        if all(ind <= base for ind in indents):
            out.append(join_paragraph(para))
        else:
            low = min(indents)
            out.append("\n".join(line[low:] for line in para))
        out.append("")
    return Corpus("jargon", "eval", "jargon-text",
                  installed_version("jargon-text"), [str(JARGON_GZ)],
                  normalize("\n".join(out)),
                  notes="body from 'Welcome to the Jargon File' on; index "
                        "lists and box-drawn tables dropped; paragraphs "
                        "joined")


# --------------------------------------------------------------------------
# Source code


def strip_licence(source: str) -> str:
    """Drops a leading // comment block that holds a copyright notice."""
    lines = source.replace("\r\n", "\n").split("\n")
    end = 0
    while end < len(lines) and lines[end].lstrip().startswith("//"):
        end += 1
    if end and any("Copyright" in line for line in lines[:end]):
        return "\n".join(lines[end:]).lstrip("\n")
    return source


def make_code() -> Corpus:
    """The googletest and googlemock library sources, one file after another.

    Each file is preceded by a comment line naming it, as a concatenating
    tool would, so a window that spans a file boundary stays valid C++ text.
    The identical BSD licence comment that opens every file is dropped: 57
    copies of it would make a good part of the corpus a verbatim repeat.
    """
    files: list[Path] = []
    for d in GTEST_DIRS:
        files.extend(p for p in (GTEST_ROOT / d).rglob("*")
                     if p.is_file() and p.suffix in (".h", ".cc"))
    files.sort(key=lambda p: p.relative_to(GTEST_ROOT).as_posix())
    if not files:
        raise RuntimeError(f"no sources under {GTEST_ROOT}")
    package = owning_package(GTEST_ROOT / GTEST_DIRS[0])
    parts = []
    for p in files:
        rel = p.relative_to(GTEST_ROOT).as_posix()
        body = strip_licence(p.read_bytes().decode("utf-8"))
        parts.append(f"// File: {rel}\n\n{normalize(body)}\n")
    return Corpus("code", "eval", package, installed_version(package),
                  [str(GTEST_ROOT / d) for d in GTEST_DIRS],
                  normalize("".join(parts)),
                  notes=f"{len(files)} .h/.cc files in path order, each "
                        "after a '// File: <path>' line",
                  extra={"files": len(files)})


# --------------------------------------------------------------------------
# Jane Austen: a minimal reader of R's serialization format.
#
# janeaustenr keeps its data in an R lazy-load database: data/Rdata.rdx (a
# gzip-compressed serialized list: object name -> offset and length) and
# data/Rdata.rdb (the objects, each a 4-byte big-endian uncompressed length
# and a zlib stream, or for newer R a type byte and bzip2/xz). Each object
# is a serialized character vector, one element per line of the Project
# Gutenberg text. The reader below covers the types such files hold.


class RReader:
    """Unserializes R's XDR ("X\\n") format into Python values.

    Character vectors become lists of str (None for NA), other atomic
    vectors lists of numbers, generic vectors lists, pairlists dicts of
    tag -> value; attributes are returned alongside via `RObj`.
    """

    NILVALUE, GLOBALENV, UNBOUND, MISSING, BASENS = 254, 253, 252, 251, 250
    NAMESPACE, PACKAGE, PERSIST = 249, 248, 247
    EMPTYENV, BASEENV, ATTRLANG, ATTRLIST, ALTREP, REF = \
        242, 241, 240, 239, 238, 255

    def __init__(self, data: bytes):
        self.buf = data
        self.pos = 0
        self.refs: list = []

    def _int(self) -> int:
        (v,) = struct.unpack_from(">i", self.buf, self.pos)
        self.pos += 4
        return v

    def _bytes(self, n: int) -> bytes:
        b = self.buf[self.pos:self.pos + n]
        if len(b) != n:
            raise ValueError("truncated R serialization")
        self.pos += n
        return b

    def _length(self) -> int:
        n = self._int()
        if n == -1:  # Long vector: two more ints.
            hi, lo = self._int(), self._int()
            n = (hi << 32) + lo
        return n

    def read(self):
        """Reads the header and the top-level object."""
        fmt = self._bytes(2)
        if fmt != b"X\n":
            raise ValueError(f"unsupported R serialization format {fmt!r}")
        version = self._int()
        self._int()  # Writer's R version.
        self._int()  # Minimal reader version.
        if version == 3:
            self._bytes(self._int())  # Native encoding name.
        elif version != 2:
            raise ValueError(f"unsupported R serialization version {version}")
        return self.item()

    def item(self):
        flags = self._int()
        typ = flags & 0xFF
        has_attr = bool(flags & (1 << 9))
        if typ == self.NILVALUE:
            return None
        if typ in (self.GLOBALENV, self.UNBOUND, self.MISSING, self.BASENS,
                   self.EMPTYENV, self.BASEENV):
            return f"<special {typ}>"
        if typ == self.REF:
            idx = flags >> 8
            if idx == 0:
                idx = self._int()
            return self.refs[idx - 1]
        if typ in (self.NAMESPACE, self.PACKAGE, self.PERSIST):
            if self._int() != 0:
                raise ValueError("unexpected string-vector flag")
            names = [self.item() for _ in range(self._int())]
            value = f"<{typ} {names}>"
            self.refs.append(value)
            return value
        if typ == 1:  # SYMSXP
            value = RSym(self.item())
            self.refs.append(value)
            return value
        if typ == 4:  # ENVSXP
            env = RObj("environment")
            self.refs.append(env)
            self._int()  # Locked.
            env.value = [self.item(), self.item(), self.item()]
            env.attrs = self.item()
            return env
        if typ in (2, 3, 5, 6, 17, self.ATTRLANG, self.ATTRLIST):
            return self._pairlist(flags)
        if typ == 9:  # CHARSXP
            n = self._int()
            if n == -1:
                return None
            return self._bytes(n).decode("utf-8", errors="strict")
        if typ in (10, 13):  # LGLSXP, INTSXP
            n = self._length()
            value = list(struct.unpack_from(f">{n}i", self._bytes(4 * n)))
        elif typ == 14:  # REALSXP
            n = self._length()
            value = list(struct.unpack_from(f">{n}d", self._bytes(8 * n)))
        elif typ == 15:  # CPLXSXP
            n = self._length()
            value = list(struct.unpack_from(f">{2 * n}d",
                                            self._bytes(16 * n)))
        elif typ == 16:  # STRSXP
            value = [self.item() for _ in range(self._length())]
        elif typ in (19, 20):  # VECSXP, EXPRSXP
            value = [self.item() for _ in range(self._length())]
        elif typ == 24:  # RAWSXP
            value = self._bytes(self._length())
        elif typ == self.ALTREP:
            return self._altrep()
        else:
            raise ValueError(f"unsupported R SEXP type {typ}")
        if has_attr:
            return RObj(typ, value, self.item())
        return value

    def _pairlist(self, flags: int):
        """Reads a pairlist (iteratively along the cdr) into an RObj."""
        items: list[tuple[object, object]] = []
        first_type = flags & 0xFF
        attrs = None
        while True:
            typ = flags & 0xFF
            if typ == self.NILVALUE:
                break
            if typ not in (2, 3, 5, 6, 17, self.ATTRLANG, self.ATTRLIST):
                # A cdr that is not a pairlist cell: an item on its own.
                self.pos -= 4
                items.append((None, self.item()))
                break
            attr = self.item() if flags & (1 << 9) else None
            if attrs is None:
                attrs = attr
            tag = self.item() if flags & (1 << 10) else None
            items.append((tag, self.item()))
            flags = self._int()
        obj = RObj(first_type, items, attrs)
        return obj

    def _altrep(self):
        info = self.item()
        state = self.item()
        attrs = self.item()
        cls = info.value[0][1] if isinstance(info, RObj) else info
        name = str(cls)
        if "compact_intseq" in name or "compact_realseq" in name:
            n, start, step = (state if isinstance(state, list) else state.value)
            value = [start + i * step for i in range(int(n))]
        elif "wrap_" in name or "deferred_string" in name:
            value = state[0] if isinstance(state, list) else state.value[0][1]
            if isinstance(value, RObj):
                value = value.value
        else:
            raise ValueError(f"unsupported ALTREP class {name}")
        return RObj("altrep", value, attrs) if attrs is not None else value


@dataclass
class RSym:
    """An R symbol."""

    name: str

    def __str__(self) -> str:
        return self.name


@dataclass
class RObj:
    """An R value with attributes (or a pairlist: value = [(tag, item)])."""

    type: object
    value: object = None
    attrs: object = None

    def attr(self, name: str):
        """An attribute by name, or None."""
        if isinstance(self.attrs, RObj):
            for tag, val in self.attrs.value:
                if str(tag) == name:
                    return val
        return None


def strip_attrs(value):
    """The plain value of an RObj (attributes dropped)."""
    return value.value if isinstance(value, RObj) else value


def read_lazyload_db(rdx: bytes, rdb: bytes) -> dict[str, object]:
    """Reads every variable of an R lazy-load database (.rdx/.rdb pair)."""
    index = RReader(gzip.decompress(rdx) if rdx[:2] == b"\x1f\x8b"
                    else zlib.decompress(rdx[4:])).read()
    # index is list(variables = list(<name> = c(offset, length)),
    # references = ..., compressed = TRUE or 2L/3L).
    fields = dict(zip(index.attr("names"), index.value))
    variables = fields["variables"]
    compressed = strip_attrs(fields.get("compressed", [1]))[0]
    result = {}
    for name, span in zip(variables.attr("names"), variables.value):
        offset, length = (int(x) for x in strip_attrs(span))
        blob = rdb[offset:offset + length]
        (size,) = struct.unpack(">I", blob[:4])
        if compressed in (True, 1):
            data = zlib.decompress(blob[4:])
        else:
            kind, payload = blob[4:5], blob[5:]
            data = {b"Z": zlib.decompress, b"2": bz2.decompress,
                    b"3": lzma.decompress, b"0": bytes}[kind](payload)
        if len(data) != size:
            raise ValueError(f"{name}: {len(data)} bytes, header says {size}")
        result[name] = RReader(data).read()
    return result


def read_deb_members(deb: Path, wanted: tuple[str, ...]) -> dict[str, bytes]:
    """Reads files out of a .deb without installing it (dpkg-deb --fsys-tarfile)."""
    tar_bytes = run(["dpkg-deb", "--fsys-tarfile", str(deb)])
    out = {}
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        for member in tar.getmembers():
            path = member.name.lstrip("./")
            if path in wanted and member.isfile():
                out[path] = tar.extractfile(member).read()
    missing = set(wanted) - set(out)
    if missing:
        raise RuntimeError(f"{deb}: missing {sorted(missing)}")
    return out


def austen_text(lines: list[str | None]) -> str:
    """Joins a novel's hard-wrapped lines into one line per paragraph.

    The vector holds the Gutenberg text line by line (title page included),
    with "" between paragraphs; chapter headings are paragraphs of their own.
    """
    out: list[str] = []
    para: list[str] = []
    for line in lines:
        line = (line or "").strip()
        if line:
            para.append(line)
        elif para:
            out.extend([join_paragraph(para), ""])
            para = []
    if para:
        out.append(join_paragraph(para))
    return "\n".join(out)


def make_austen(deb: Path | None) -> tuple[Corpus, Corpus]:
    """The Austen eval corpus and the calibration text (a different novel)."""
    package = "r-cran-janeaustenr"
    rdx_path = f"{JANEAUSTENR_DATA}/Rdata.rdx"
    rdb_path = f"{JANEAUSTENR_DATA}/Rdata.rdb"
    if deb is not None:
        version = run(["dpkg-deb", "-f", str(deb), "Version"]).decode().strip()
        members = read_deb_members(deb, (rdx_path, rdb_path))
        rdx, rdb = members[rdx_path], members[rdb_path]
    else:
        version = installed_version(package)
        rdx = Path("/" + rdx_path).read_bytes()
        rdb = Path("/" + rdb_path).read_bytes()
    objects = read_lazyload_db(rdx, rdb)

    def novels(selection):
        texts = []
        for key, title in selection:
            lines = strip_attrs(objects[key])
            if not isinstance(lines, list) or not all(
                    isinstance(x, (str, type(None))) for x in lines):
                raise RuntimeError(f"janeaustenr::{key} is not a character "
                                   "vector")
            texts.append(austen_text(lines))
        return normalize("\n\n".join(texts))

    sources = [f"{package}:/{rdx_path}", f"{package}:/{rdb_path}"]
    austen = Corpus("austen", "eval", package, version, sources,
                    novels(AUSTEN_EVAL),
                    notes="novels " + ", ".join(t for _, t in AUSTEN_EVAL) +
                          "; read from the R lazy-load database without R; "
                          "paragraphs joined")
    calibration = Corpus("calibration", "calibration", package, version,
                         sources, novels(AUSTEN_CALIBRATION),
                         notes="novel " + AUSTEN_CALIBRATION[0][1] +
                               ", which no eval corpus contains")
    return austen, calibration


# --------------------------------------------------------------------------


def write_atomic(path: Path, data: bytes) -> None:
    """Writes a file through a temporary name so readers never see half."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; the data is public.
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main(argv: list[str]) -> int:
    """Builds every corpus and the manifest."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", required=True, type=Path)
    ap.add_argument("--austen-deb", type=Path,
                    help="r-cran-janeaustenr .deb to read (default: the "
                         "installed package)")
    args = ap.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)

    austen, calibration = make_austen(args.austen_deb)
    corpora = [make_kjv(), make_jargon(), austen, make_code(), calibration]

    # The calibration text must share no paragraph with any eval text.
    calib_paras = {p for p in calibration.text.split("\n\n") if len(p) > 200}
    for c in corpora:
        if c.role == "eval" and calib_paras & set(c.text.split("\n\n")):
            raise RuntimeError(f"calibration text overlaps {c.name}")

    manifest = []
    for c in corpora:
        data = c.text.encode("utf-8")
        if c.role == "eval" and len(data) < MIN_BYTES:
            raise RuntimeError(f"{c.name}: only {len(data)} bytes")
        write_atomic(args.out_dir / f"{c.name}.txt", data)
        entry = {"name": c.name, "file": f"{c.name}.txt", "role": c.role,
                 "package": c.package, "version": c.version,
                 "sources": c.sources, "bytes": len(data),
                 "sha256": hashlib.sha256(data).hexdigest(), "notes": c.notes}
        entry.update(c.extra)
        manifest.append(entry)
        print(f"kvq: corpus {c.name:12s} {c.role:11s} {len(data):9d} bytes "
              f"from {c.package} {c.version}", file=sys.stderr)
    write_atomic(args.out_dir / "MANIFEST.json",
                 (json.dumps({"corpora": manifest}, indent=2) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
