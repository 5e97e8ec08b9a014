"""The `english` corpus: reading .deb files, `compress`ed and SWORD data, cleaning, the fixed
splits and `CharText`'s test split, and the whole fetch offline (a fake downloader)."""

import hashlib
import io
import json
import random
import shutil
import struct
import subprocess
import tarfile
import urllib.error
import urllib.request
import zlib

import numpy as np
import pytest

from spinformer import cli, data
from spinformer.data import _corpus, _text


def make_deb(files: dict, data_member: str = "data.tar.xz") -> bytes:
    """A .deb in memory: `ar` with debian-binary, an odd-sized member (padded),
    control.tar.xz and `data_member`."""
    def tar(members: dict, mode: str) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode=mode) as t:
            for name, content in members.items():
                info = tarfile.TarInfo("./" + name)
                info.size = len(content)
                t.addfile(info, io.BytesIO(content))
        return buf.getvalue()

    compression = data_member.rsplit(".", 1)[1]
    payload = (tar(files, f"w:{compression}") if compression in ("gz", "xz") else b"(zstd)")
    out = bytearray(b"!<arch>\n")
    for name, content in (("debian-binary", b"2.0\n"), ("_odd", b"odd"),
                          ("control.tar.xz", tar({"control": b"Package: x\n"}, "w:xz")),
                          (data_member, payload)):
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(content):<10}`\n".encode()
        out += content + b"\n" * (len(content) % 2)
    return bytes(out)


def lzw_compress(raw: bytes, maxbits: int = 16) -> bytes:
    """Unix `compress` without its header, clearing the table whenever it is full (a
    reference for `lzw_decompress`; `gzip -dc` reads its output, see `test_lzw`)."""
    table, size, n_bits, out, group, w = {bytes([i]): i for i in range(256)}, 257, 9, [], [], b""

    def flush(nbytes):
        out.append(sum(c << (k * n_bits) for k, c in enumerate(group)).to_bytes(nbytes, "little"))
        group.clear()

    def emit(code):
        nonlocal n_bits
        if size - 1 >= 1 << n_bits and n_bits < maxbits:  # (always between two groups)
            n_bits += 1
        group.append(code)
        if len(group) == 8:
            flush(n_bits)

    for c in raw:
        if w + bytes([c]) in table:
            w += bytes([c])
            continue
        emit(table[w])
        if size < 1 << maxbits:
            table[w + bytes([c])], size = size, size + 1
        else:
            emit(256)  # its group ends with it
            if group:
                flush(n_bits)
            table, size, n_bits = {bytes([i]): i for i in range(256)}, 257, 9
        w = bytes([c])
    if w:
        emit(table[w])
    if group:
        flush((len(group) * n_bits + 7) // 8)
    return b"".join(out)


def bible_data(text: bytes, wsize: int = 64) -> bytes:
    """A `bible.data` file: header, window offsets and `compress`ed windows of `wsize` bytes."""
    windows = [lzw_compress(text[i:i + wsize]) for i in range(0, len(text), wsize)]
    start = 92 + 4 * (len(windows) + 1) + 3
    offsets = [start + sum(map(len, windows[:i])) for i in range(len(windows) + 1)]
    head = b"EC02" + b"Compressed Data File".ljust(80, b"\0")
    head += struct.pack(f">II{len(offsets)}I", wsize, len(windows), *offsets)
    return head + b"\x1f\x9d\x90" + b"".join(windows)


def sword(entries: list) -> dict:
    """A zCom module's `.czs` index and `.czz` zlib blocks, one block per entry."""
    blocks = [zlib.compress(e.encode()) for e in entries]
    starts = [sum(map(len, blocks[:i])) for i in range(len(blocks))]
    index = b"".join(struct.pack("<3I", s, len(b), len(e.encode()))
                     for s, b, e in zip(starts, blocks, entries))
    return {"ot.czs": index, "ot.czz": b"".join(blocks)}


def test_read_deb():
    files = {"usr/lib/a.txt": b"alpha\n", "usr/share/b": bytes(range(7))}  # odd size: padding
    for member in ("data.tar.xz", "data.tar.gz"):
        assert _corpus.read_deb(make_deb(files, member)) == files
    with pytest.raises(ValueError, match="data.tar.zst is compressed in a way"):
        _corpus.read_deb(make_deb(files, "data.tar.zst"))
    with pytest.raises(ValueError, match="not a Debian package"):
        _corpus.read_deb(b"PK\x03\x04 a zip file")


def test_lzw():
    rng = random.Random(0)
    words = "the of and to in that is was he for it with as his on be at by I not".split()
    for n, maxbits in ((0, 16), (3, 16), (2000, 16), (30000, 10)):  # 10 bits: tables clear
        raw = " ".join(rng.choice(words) for _ in range(n)).encode() + b"a" * 40 + b"b"
        packed = lzw_compress(raw, maxbits)
        assert _corpus.lzw_decompress(packed, maxbits) == raw
        if shutil.which("gzip"):  # gzip reads `compress` files: the reference is right
            header = bytes([0x1F, 0x9D, 0x80 | maxbits])
            assert subprocess.run(["gzip", "-dc"], input=header + packed,
                                  capture_output=True).stdout == raw


def test_kjv_and_osis_text():
    bible = (b"Holy Bible, Authorized (King James) Version.\nGe1:1 In the beginning God.\n"
             b"Ge1:10 And God called the dry land Earth.\nGe2:1 Thus the heavens were finished."
             b"\n1Sm3:1 And the child Samuel ministered.\n")
    assert _corpus.kjv_text({"usr/lib/bible.data": bible_data(bible)}) == (
        "\nIn the beginning God.\nAnd God called the dry land Earth.\n\n"
        "Thus the heavens were finished.\n\nAnd the child Samuel ministered.\n")
    entries = ['<div type="book" sID="g1"/> <title type="x-s">Psalm 1 OVERVIEW</title> '
               '<div sID="g2" type="x-p"/> Blessed <hi type="italic">is</hi> the man &amp; '
               'his <reference>way</reference>. <div eID="g2" type="x-p"/>',
               '<div sID="g3" type="x-p"/>Verse  1. He <hi>walketh</hi> not.<div eID="g3"/>']
    prefix = "usr/share/sword/modules/comments/zcom/tdavid/"
    files = {prefix + k: v for k, v in sword(entries).items()}
    assert _corpus.clean(_corpus.tdavid_text(files)) == (
        "Psalm 1 OVERVIEW\n\nBlessed is the man & his way.\n\nVerse 1. He walketh not.\n")


def test_clean():
    raw = ("\u201cWell,\u201d quoth he \u2014 \u2018tis caf\u00e9\u2026\tdone.   \r\n"
           "\n\n\n\nThe \ufb01eld of \u05d0\u05d1 Hebrew\x84.\n\n")
    assert _corpus.clean(raw) == ("\"Well,\" quoth he -- 'tis cafe... done.\n\n"
                                  "The field of  Hebrew.\n")
    text = _corpus.clean("".join(map(chr, range(0x2200))))  # every character becomes ASCII
    assert set(text) <= {"\n", *map(chr, range(32, 127))}


def docs_for_layout():
    """Three documents of different sizes; the first has one-character lines."""
    rng = random.Random(1)
    return {"short": "a\nb\n" * 500,
            "verse": "".join(f"verse {i} " + "x" * rng.randrange(20) + "\n" for i in range(700)),
            "prose": "".join("word " * rng.randrange(5, 60) + "\n" for _ in range(400))}


def test_layout():
    docs = docs_for_layout()
    text, rec = _corpus.layout(docs)
    n = sum(map(len, docs.values()))
    assert len(text) == rec["chars"] == n and sorted(text) == sorted("".join(docs.values()))
    assert rec["test"] == [n - round(0.05 * n), n]
    assert rec["val"] == [n - 2 * round(0.05 * n), n - round(0.05 * n)]
    assert rec["train"] == [0, rec["val"][0]] and rec["sha256"] == hashlib.sha256(
        text.encode()).hexdigest()
    # the splits hold each document's parts in order: train parts, then val, then test
    at, longest = 0, max(len(line) + 1 for doc in docs.values() for line in doc.split("\n"))
    for split in ("train", "val", "test"):
        assert at == rec[split][0]
        for name, doc in docs.items():
            size, before = rec["sources"][name][split], {"train": 0, "val": 1, "test": 2}[split]
            start = sum(rec["sources"][name][s] for s in ("train", "val", "test")[:before])
            assert size > 0 and text[at:at + size] == doc[start:start + size]
            assert start == 0 or doc[start - 1] == "\n"  # cut at a line start
            share = 0.9 if split == "train" else 0.05  # near its share: within a few lines
            assert abs(size - share * len(doc)) <= 2 * longest
            at += size
        assert at == rec[split][1]
    ct = data.CharText(text, seq_len=4, val_fraction=0.05, test_fraction=0.05)
    for split, d in (("train", ct.train_data), ("val", ct.val_data), ("test", ct.test_data)):
        assert ct.decode(d) == text[slice(*rec[split])]
    with pytest.raises(ValueError, match="too few lines"):
        _corpus.layout({"a": "one long line\n", "b": "another line\n"})


def test_char_text_test_split():
    rng = random.Random(0)
    text = "".join(rng.choice("abcdefgh") for _ in range(1000))
    old = data.CharText(text, seq_len=8, batch_size=4)  # default: no test split, as before
    assert len(old.train_data) == 900 and len(old.val_data) == 100 and not len(old.test_data)
    assert old.decode(old.val_data) == text[900:]
    with pytest.raises(ValueError, match="no test split"):
        old.batch(0, "test")
    ct = data.CharText(text, seq_len=8, batch_size=4, val_fraction=0.1, test_fraction=0.2)
    assert (len(ct.train_data), len(ct.val_data), len(ct.test_data)) == (700, 100, 200)
    assert ct.decode(ct.test_data) == text[800:] and ct.decode(ct.val_data) == text[700:800]
    batch = ct.batch(3, "test")
    assert batch["inputs"].shape == (4, 8)
    windows = {text[i:i + 9] for i in range(800, 992)}  # test windows and their next characters
    for x, y in zip(batch["inputs"], batch["targets"]):
        assert ct.decode(x) + ct.decode(y[-1:]) in windows and np.array_equal(x[1:], y[:-1])
    assert not np.array_equal(batch["inputs"], ct.batch(3, "val")["inputs"])
    with pytest.raises(ValueError, match=r"the test split \(val_fraction=0.1, test_fraction="
                                         r"0.005\) has 5 characters, fewer than seq_len \+ 1"):
        data.CharText(text, seq_len=8, val_fraction=0.1, test_fraction=0.005)
    with pytest.raises(ValueError, match="at most 1"):
        data.CharText(text, val_fraction=0.5, test_fraction=0.6)


def test_config_test_fraction():
    from spinformer.config import ConfigError, DataConfig

    assert DataConfig().test_fraction == 0.0
    with pytest.raises(ConfigError, match="test_fraction=0.95"):
        DataConfig(val_fraction=0.1, test_fraction=0.95)


def test_config_reaches_char_text(tmp_path):
    from spinformer.config import DataConfig
    from spinformer.train._build import _make_dataset

    p = tmp_path / "t.txt"
    p.write_text("".join(chr(97 + i % 26) for i in range(1000)))
    ds = _make_dataset(DataConfig(task="chars", path=str(p), seq_len=8, val_fraction=0.05,
                                  test_fraction=0.05))
    assert (len(ds.train_data), len(ds.val_data), len(ds.test_data)) == (900, 50, 50)


class FakeResponse(io.BytesIO):
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def serve(monkeypatch, pages: dict) -> list:
    """Answer `urlopen` from `pages` (url -> bytes; a missing url is a 404); returns the list
    of urls asked for."""
    asked = []

    def urlopen(url, timeout=None):
        asked.append(url)
        if url not in pages:
            raise urllib.error.HTTPError(url, 404, "Not Found", {}, None)
        return FakeResponse(pages[url])

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    return asked


def test_download_errors(tmp_path, monkeypatch):
    url = "https://deb.debian.org/debian/pool/main/b/bible-kjv/bible-kjv-text_4.38_all.deb"
    serve(monkeypatch, {url: b"not the package"})
    path = tmp_path / "bible-kjv-text_4.38_all.deb"
    with pytest.raises(RuntimeError, match="have sha256 .* not the pinned 0000"):
        _corpus.download(url, path, "0" * 64)
    assert not path.exists() and not list(tmp_path.iterdir())
    good = hashlib.sha256(b"not the package").hexdigest()
    assert _corpus.download(url, path, good) == b"not the package" and path.exists()
    serve(monkeypatch, {})
    assert _corpus.download(url, path, good) == b"not the package"  # kept: no download
    with pytest.raises(RuntimeError, match=r"HTTP 404 .*snapshot\.debian\.org/package/"
                                           r"bible-kjv/4\.38/ and put it at"):
        _corpus.download(url, path, good, force=True)


def test_fetch_english_offline(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPINFORMER_CACHE", str(tmp_path))
    shakespeare = _text.dataset_path("shakespeare")  # as `fetch("shakespeare")` leaves it
    shakespeare.parent.mkdir(parents=True)
    shakespeare.write_text("".join(f"KING.\nLine {i} of the play.\n\n" for i in range(300)))
    bible = "Title\n" + "".join(f"Ge{c}:{v} Verse {v} of chapter {c}.\n"
                                for c in range(1, 30) for v in range(1, 12))
    psalms = [f'<title>Psalm {i}</title><div sID="p"/>Blessed {i} \u2014 the man.<div eID="p"/>'
              for i in range(1, 200)]
    prefix = "usr/share/sword/modules/comments/zcom/tdavid/"
    debs = {"kjv": make_deb({"usr/lib/bible.data": bible_data(bible.encode(), 256)}),
            "tdavid": make_deb({prefix + k: v for k, v in sword(psalms).items()})}
    pins = {name: (f"pool/main/x/{name}/{name}_1.0_all.deb", hashlib.sha256(deb).hexdigest())
            for name, deb in debs.items()}
    monkeypatch.setattr(_corpus, "DEBS", pins)
    asked = serve(monkeypatch, {_corpus._POOL + pins[k][0]: debs[k] for k in debs})

    path = data.fetch("english")
    assert path == _text.dataset_path("english") and len(asked) == 2
    err = capsys.readouterr().err
    assert f"downloading {_corpus._POOL}pool/main/x/kjv/kjv_1.0_all.deb" in err
    assert "sha256 verified" in err and "M characters (shakespeare" in err
    assert "differs from the reference build's" in err  # not the real sources
    assert sorted(p.name for p in path.parent.iterdir()) == [
        "input.txt", "kjv_1.0_all.deb", "splits.json", "tdavid_1.0_all.deb"]  # no temporaries
    text = path.read_text()
    rec = json.loads((path.parent / "splits.json").read_text())
    assert rec["sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert set(rec["sources"]) == {"shakespeare", "kjv", "tdavid"}
    assert "Blessed 7 -- the man." in text and "Verse 3 of chapter 2." in text
    assert "Ge2:3" not in text and "<" not in text
    ct = data.CharText.from_path("english", seq_len=8, val_fraction=0.05, test_fraction=0.05)
    assert ct.decode(ct.test_data) == text[slice(*rec["test"])]
    assert ct.decode(ct.val_data) == text[slice(*rec["val"])]

    assert data.fetch("english") == path and len(asked) == 2  # there: nothing fetched again
    path.unlink()
    assert data.fetch("english").read_text() == text and len(asked) == 2  # kept packages
    _corpus.build(path, shakespeare.read_text(), force=True)  # Shakespeare given: not pip
    assert path.read_text() == text and len(asked) == 4  # force: downloaded again

    assert cli.main(["data", "list"]) == 0
    assert "english  Shakespeare, the King James Bible" in capsys.readouterr().out
