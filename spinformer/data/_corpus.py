"""The `english` corpus (`spinformer data fetch english`): Shakespeare's plays and poems, the
King James Bible and C. H. Spurgeon's *The Treasury of David* (1869-1885), all in the public
domain (the King James Version outside the United Kingdom, where Crown letters patent cover
it). The last two are read in pure Python out of pinned Debian packages, so the fetch needs
neither `apt-get` nor Debian; the text is cleaned to printable ASCII and stored as the training
parts of all sources, then their validation parts, then their test parts."""

from __future__ import annotations

import hashlib
import html
import io
import itertools
import json
import os
import pathlib
import re
import struct
import sys
import tarfile
import unicodedata
import urllib.error
import urllib.request
import zlib

# Every source's validation and test shares; the rest of it is training text.
VAL_FRACTION = TEST_FRACTION = 0.05

_POOL = "https://deb.debian.org/debian/"
# The Debian 12 (bookworm) packages read: pool path and the sha256 of the .deb.
DEBS = {
    "kjv": ("pool/main/b/bible-kjv/bible-kjv-text_4.38_all.deb",
            "d61b6aad4c51ba9e2800b825325fa6a09e99a0d02a9bb6dc4724fcc4995a1b7a"),
    "tdavid": ("pool/main/s/sword-comm-tdavid/sword-comm-tdavid_2.1-1_all.deb",
               "bcbfad701c5c4a061475b58309cebc42755a59e87478c8355227c5e046412b3f"),
}
# The sha256 of the `input.txt` these sources give; a build that differs (another Unicode
# database, changed cleaning) is reported, not refused.
TEXT_SHA256 = "887ed0602c44c88d601afeae02c177f22c5fff2e55e4fe1a2626217880cd3c07"


def download(url: str, path: pathlib.Path, sha256: str, force: bool = False) -> bytes:
    """The bytes at `url`, checked against `sha256` and kept at `path`; a file already at
    `path` with that sha256 is used without a download (unless `force`)."""
    if path.exists() and not force:
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() == sha256:
            return data
    print(f"english: downloading {url}", file=sys.stderr)
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            data = response.read()
    except urllib.error.HTTPError as e:
        source, version = url.split("/")[-2], url.split("/")[-1].split("_")[1]
        gone = (" Debian removes a version from its pool once no release ships it: download "
                f"the file from https://snapshot.debian.org/package/{source}/{version}/ and put "
                f"it at {path}, then fetch again." if e.code == 404 else "")
        raise RuntimeError(f"downloading {url} failed: HTTP {e.code} {e.reason}.{gone}") from None
    except OSError as e:
        raise RuntimeError(f"downloading {url} failed: {e}.") from None
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise RuntimeError(f"{url}: the {len(data)} bytes downloaded have sha256 {got}, not the "
                           f"pinned {sha256}; the file is corrupt or was replaced, so it is not "
                           "used. Try again, or check the pin against the Debian archive.")
    print(f"english: {path.name}: {len(data) / 1e6:.1f} MB, sha256 verified", file=sys.stderr)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    part.write_bytes(data)
    os.replace(part, path)
    return data


def read_deb(data: bytes) -> dict[str, bytes]:
    """The regular files of a Debian package, by path without the leading `./`.

    A `.deb` is an `ar` archive (`!<arch>\\n`, then members each behind a 60-byte header
    whose bytes 0-16 hold the name and 48-58 the decimal size, padded to an even length); its
    `data.tar`, `.gz`, `.xz` or `.bz2` member holds the files. Another compression (`.zst`)
    is a `ValueError`: Python's standard library cannot read it."""
    if data[:8] != b"!<arch>\n":
        raise ValueError("not a Debian package: no `ar` archive signature.")
    members, pos = {}, 8
    while pos + 60 <= len(data):
        name, size = data[pos:pos + 16].decode().strip().rstrip("/"), int(data[pos + 48:pos + 58])
        members[name] = data[pos + 60:pos + 60 + size]
        pos += 60 + size + size % 2
    tars = [n for n in members if n.startswith("data.tar")]
    if not tars:
        raise ValueError(f"the package has no data.tar member (it has {sorted(members)}).")
    if tars[0] not in ("data.tar", "data.tar.gz", "data.tar.xz", "data.tar.bz2"):
        raise ValueError(f"the package's {tars[0]} is compressed in a way Python's standard "
                         "library cannot read.")
    with tarfile.open(fileobj=io.BytesIO(members[tars[0]])) as tar:
        return {m.name.removeprefix("./"): tar.extractfile(m).read() for m in tar if m.isfile()}


def lzw_decompress(data: bytes, maxbits: int = 16) -> bytes:
    """Undo Unix `compress` (LZW, block mode, the 3-byte header already removed): codes of 9
    bits growing to `maxbits`, packed least significant bit first in groups of `n_bits` bytes
    (8 codes; the width grows between groups); code 256 clears the table and ends its group."""
    out, table, n_bits, pos, prev = bytearray(), [bytes([i]) for i in range(256)] + [b""], 9, 0, b""
    while pos < len(data):
        group = data[pos:pos + n_bits]
        pos += n_bits
        bits = int.from_bytes(group, "little")
        for k in range(len(group) * 8 // n_bits):
            code = (bits >> (k * n_bits)) & ((1 << n_bits) - 1)
            if code == 256:
                del table[257:]
                n_bits, prev = 9, b""
                break
            entry = table[code] if code < len(table) else prev + prev[:1]
            out += entry
            if prev and len(table) < 1 << maxbits:
                table.append(prev + entry[:1])
            prev = entry
            if len(table) >= 1 << n_bits and n_bits < maxbits:
                n_bits += 1  # always after a group's last code
    return bytes(out)


def kjv_text(files: dict[str, bytes]) -> str:
    """The King James Bible from `bible-kjv-text`'s `usr/lib/bible.data`: the magic `EC02`,
    an 80-byte description, the window size and count and the windows' offsets (big-endian
    32-bit), then windows of `compress`ed text, one verse a line (`Ge1:1 In the beginning`).
    The first line (the file's title) and the verse references are dropped; each chapter
    starts after a blank line."""
    d = files["usr/lib/bible.data"]
    if d[:4] != b"EC02":
        raise ValueError("usr/lib/bible.data does not start with the magic EC02.")
    wnum = struct.unpack(">I", d[88:92])[0]
    offsets = struct.unpack(f">{wnum + 1}I", d[92:96 + 4 * wnum])
    maxbits = d[offsets[0] - 1] & 0x1F
    text = b"".join(lzw_decompress(d[a:b], maxbits) for a, b in zip(offsets, offsets[1:]))
    text = text.decode("ascii").split("\n", 1)[1]
    text = re.sub(r"(?m)^\d?[A-Za-z]+\d+:1 ", "\n", text)
    return re.sub(r"(?m)^\d?[A-Za-z]+\d+:\d+ ", "", text)


def sword_text(files: dict[str, bytes], stem: str) -> str:
    """The markup of a compressed SWORD module (`zText`, `zCom`): `stem + "s"` indexes blocks
    (offset, size, uncompressed size: little-endian 32-bit) of zlib-compressed UTF-8 in
    `stem + "z"`; the blocks in order hold the module's entries in order."""
    index, data = files[stem + "s"], files[stem + "z"]
    blocks = (zlib.decompress(data[o:o + n]) for o, n, _ in struct.iter_unpack("<3I", index) if n)
    return b"".join(blocks).decode("utf-8")


def osis_text(osis: str) -> str:
    """Plain text from OSIS markup: a title's text on a line of its own between blank lines;
    a structural tag (`div` paragraph marks, `chapter`, `l`, `lg`, `list`, `item`) a line
    break, so that a paragraph's start and end marks leave a blank line between paragraphs;
    other tags (`hi`, `reference`, `milestone`) dropped; entities decoded; runs of spaces
    made one; lines stripped."""
    s = re.sub(r"<title\b[^>]*>(.*?)</title>", r"\n\n\1\n\n", osis)
    s = re.sub(r"</?(?:div|chapter|lg|l|list|item)\b[^>]*>", "\n", s)
    s = html.unescape(re.sub(r"<[^>]*>", "", s))
    return "\n".join(" ".join(line.split()) for line in s.split("\n"))


def tdavid_text(files: dict[str, bytes]) -> str:
    """Spurgeon's *The Treasury of David* from `sword-comm-tdavid` (`osis_text` of its
    module)."""
    return osis_text(sword_text(files, "usr/share/sword/modules/comments/zcom/tdavid/ot.cz"))


_PUNCTUATION = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"',
                              "\u2013": "-", "\u2014": "--", "\t": " "})


def clean(text: str) -> str:
    """Printable ASCII and newlines: Windows line ends become `\\n`; curly quotes become
    straight ones, an en dash `-`, an em dash `--`, a tab a space; Unicode NFKD then splits
    accented letters from their accents and spells out ligatures, ellipses and non-breaking
    spaces; every character left outside printable ASCII (32-126) and `\\n` is dropped (the
    accents, a few Hebrew and Greek words, stray control codes). Trailing spaces are stripped,
    runs of three or more newlines become two, and the text ends with exactly one newline."""
    text = unicodedata.normalize("NFKD", text.replace("\r\n", "\n").translate(_PUNCTUATION))
    text = re.sub(r"[^\n -~]", "", text)
    text = re.sub(r" +\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n") + "\n"


def _line_starts(doc: str) -> list[int]:
    """Where the lines after the first start (the end of the text is not a start)."""
    return [m.end() for m in re.finditer("\n", doc[:-1])]


def _cuts(docs: list[str], tail: int) -> list[int]:
    """One cut per document, each at the start of a line, such that the documents' tails after
    their cuts hold `tail` characters together. The documents are cut near their own share of
    the tail: each but the one with the most lines at one of the 32 line starts nearest it
    (the combination nearest in all first), and that one where the total comes out exact,
    which must be a line start too."""
    n = sum(map(len, docs))
    marks = [len(d) * (1 - tail / n) for d in docs]
    starts = [_line_starts(d) for d in docs]
    rest = max(range(len(docs)), key=lambda i: len(starts[i]))
    others = [i for i in range(len(docs)) if i != rest]
    near = [sorted(starts[i], key=lambda c, m=marks[i]: abs(c - m))[:32] for i in others]
    ok = set(starts[rest])
    for combo in sorted(itertools.product(*near),
                        key=lambda cs: sum(abs(c - marks[i]) for i, c in zip(others, cs))):
        cuts = dict(zip(others, combo))
        cuts[rest] = len(docs[rest]) - tail + sum(len(docs[i]) - c for i, c in cuts.items())
        if cuts[rest] in ok:
            return [cuts[i] for i in range(len(docs))]
    raise ValueError(f"no cuts at line starts give tails of exactly {tail} characters; the "
                     "documents have too few lines.")


def layout(docs: dict[str, str], val_fraction: float = VAL_FRACTION,
           test_fraction: float = TEST_FRACTION) -> tuple[str, dict]:
    """The corpus text and its `splits.json` record from cleaned documents (each ending in a
    newline).

    Each document is cut at two line starts into training, validation and test parts of about
    `1 - val_fraction - test_fraction`, `val_fraction` and `test_fraction` of its characters;
    the text is the training parts in the documents' order, then the validation parts, then
    the test parts. Of its `n` characters the last `round(n * test_fraction)` are exactly the
    test parts and the `round(n * val_fraction)` before them the validation parts (`_cuts`),
    so `CharText(text, val_fraction=..., test_fraction=...)` splits the text where the
    documents were cut.

    **Returns:** `(text, record)`; `record` holds `chars`, `train`/`val`/`test` as `[start,
    end)` character offsets, `sha256` (of the text as UTF-8) and `sources`: per document its
    `chars` and the `train`, `val`, `test` characters it gives."""
    parts = list(docs.values())
    n = sum(map(len, parts))
    n_test, n_val = int(round(n * test_fraction)), int(round(n * val_fraction))
    test_at, val_at = _cuts(parts, n_test), _cuts(parts, n_test + n_val)
    if any(not 0 < v < t for v, t in zip(val_at, test_at)):
        raise ValueError("a document's validation part would be empty; it is too short.")
    splits = {"train": [d[:v] for d, v in zip(parts, val_at)],
              "val": [d[v:t] for d, v, t in zip(parts, val_at, test_at)],
              "test": [d[t:] for d, t in zip(parts, test_at)]}
    text = "".join(itertools.chain(*splits.values()))
    n_train = n - n_val - n_test
    record = {
        "chars": n, "train": [0, n_train], "val": [n_train, n - n_test], "test": [n - n_test, n],
        "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "sources": {name: {"chars": len(d), **{s: len(p[i]) for s, p in splits.items()}}
                    for i, (name, d) in enumerate(docs.items())},
    }
    return text, record


def build(out: pathlib.Path, shakespeare: str, force: bool = False) -> None:
    """Write the `english` corpus to `out` (`input.txt`) and `splits.json` beside it.

    The sources, in this order: `shakespeare` (the text given, that of
    `data.fetch("shakespeare")`), `kjv`
    (`kjv_text`, from the Debian package `bible-kjv-text` 4.38) and `tdavid` (`tdavid_text`,
    from `sword-comm-tdavid` 2.1-1; both packages' copyright files call their texts public
    domain), each `clean`ed and laid out by `layout` (90 % training,
    5 % validation, 5 % test of every source). The packages are downloaded from
    deb.debian.org over HTTPS with `urllib`, checked against their pinned sha256 and kept
    beside `out`; `force` downloads them again. Both files are written under temporary names
    and renamed into place, `input.txt` last."""
    docs = {"shakespeare": shakespeare}
    readers = {"kjv": kjv_text, "tdavid": tdavid_text}
    for name, (pool_path, sha256) in DEBS.items():
        deb = download(_POOL + pool_path, out.parent / pool_path.rsplit("/", 1)[1], sha256, force)
        docs[name] = readers[name](read_deb(deb))
    text, record = layout({name: clean(doc) for name, doc in docs.items()})
    sizes = ", ".join(f"{k} {v['chars'] / 1e6:.1f}" for k, v in record["sources"].items())
    print(f"english: {record['chars'] / 1e6:.1f} M characters ({sizes})", file=sys.stderr)
    if record["sha256"] != TEXT_SHA256:
        print(f"english: note: the text's sha256 {record['sha256']} differs from the reference "
              f"build's {TEXT_SHA256}", file=sys.stderr)
    for path, content in ((out.parent / "splits.json", json.dumps(record, indent=1) + "\n"),
                          (out, text)):
        part = path.with_name(path.name + ".part")
        part.write_bytes(content.encode("utf-8"))  # bytes: "\n" stays "\n" on every system
        os.replace(part, path)
