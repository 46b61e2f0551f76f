"""The framed file (`cache.container`) both cache files and prefix chunks are: `frame` writes prefix, header,
payload and digest; `unframe` gives them back and refuses anything else with a `CacheFileError` naming why;
`read_regular` reads regular files only, bounded, and not past a foreign prefix."""

from __future__ import annotations

import hashlib
import hmac
import json
import os

import pytest

from hf_kvcompress import CacheFileError
from hf_kvcompress.cache.container import DIGEST_BYTES, PREFIX, frame, read_regular, unframe

MAGIC = b"\x89TEST\r\n\x1a"
HEADER = {"format": "test", "n": [1, 2, 3]}
PAYLOAD = bytes(range(256)) * 3


def test_frame_is_prefix_header_payload_and_a_digest_over_them():
    for key in (None, b"secret"):
        data = b"".join(frame(MAGIC, 7, HEADER, bytearray(PAYLOAD), key))
        blob = json.dumps(HEADER, separators=(",", ":")).encode()
        body = PREFIX.pack(MAGIC, 7, len(blob)) + blob + PAYLOAD
        want = hashlib.sha256(body).digest() if key is None else hmac.new(key, body, hashlib.sha256).digest()
        assert data == body + want
        framed = unframe(data, MAGIC, (7,), "test", key=key)
        assert (framed.version, framed.header, framed.payload) == (7, HEADER, PAYLOAD)


@pytest.mark.parametrize(("damage", "why"), [
    (lambda d: b"\x89OTHER\r\n" + d[8:], "not an hf_kvcompress test file"),
    (lambda d: d[:5], "truncated: 5 bytes"),
    (lambda d: d[:8] + (9).to_bytes(4, "little") + d[12:], r"test format version 9, this library reads \[7\] \(why\)"),
    (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "checksum mismatch"),
    (lambda d: d[:-DIGEST_BYTES] + hashlib.sha1(d[:-DIGEST_BYTES]).digest(), "checksum mismatch"),
])
def test_unframe_refuses_what_is_not_the_frame(damage, why):
    data = b"".join(frame(MAGIC, 7, HEADER, PAYLOAD))
    with pytest.raises(CacheFileError, match=why):
        unframe(damage(data), MAGIC, (7,), "test", version_note=lambda version: " (why)")


def test_unframe_refuses_a_header_that_overruns_or_does_not_parse():
    body = PREFIX.pack(MAGIC, 7, 1000) + b"{}"
    with pytest.raises(CacheFileError, match="header of 1000 bytes does not fit"):
        unframe(body + hashlib.sha256(body).digest(), MAGIC, (7,), "test")
    body = PREFIX.pack(MAGIC, 7, 3) + b"{x}"
    with pytest.raises(CacheFileError, match="corrupt header"):
        unframe(body + hashlib.sha256(body).digest(), MAGIC, (7,), "test")
    keyed = b"".join(frame(MAGIC, 7, HEADER, PAYLOAD, b"one"))
    with pytest.raises(CacheFileError, match="without this store's secret"):
        unframe(keyed, MAGIC, (7,), "test", key=b"other")


def test_read_regular_reads_regular_files_only_bounded_and_not_past_a_foreign_prefix(tmp_path):
    path = tmp_path / "f"
    data = b"".join(frame(MAGIC, 7, HEADER, PAYLOAD))
    path.write_bytes(data)
    assert read_regular(path, magic=MAGIC) == data
    assert read_regular(path, magic=b"\x89OTHER\r\n") == data[: PREFIX.size]  # the rest is never read
    with pytest.raises(CacheFileError, match=f"{len(data)} bytes, more than"):
        read_regular(path, magic=MAGIC, max_bytes=len(data) - 1)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(CacheFileError, match="not a regular file"):
        read_regular(tmp_path / "fifo", magic=MAGIC)
    (tmp_path / "link").symlink_to(path)
    assert read_regular(tmp_path / "link", magic=MAGIC) == data
    with pytest.raises(CacheFileError, match="cannot read the file"):
        read_regular(tmp_path / "link", magic=MAGIC, follow_links=False)
    with pytest.raises(CacheFileError) as info:
        read_regular(tmp_path / "missing", magic=MAGIC)
    assert isinstance(info.value.__cause__, FileNotFoundError)


def _coded_block(start: int, config, dim: int = 4, value_dim: int = 6, tokens: int = 3):
    """A one-row block of one head whose streams are real codec streams ([width, tokens] bfloat16)."""
    from array import array

    import torch

    from hf_kvcompress import codec
    from hf_kvcompress.blockcodec import CodedBlock, CodedRow

    blobs = [codec.encode(torch.randn(width, tokens).to(torch.bfloat16), config=config) for width in (dim, value_dim)]
    row = CodedRow(blobs, array("b", [0, 0]), {})
    return CodedBlock(0, start, tokens, [row], 1, dim, torch.bfloat16, torch.device("cpu"), value_dim=value_dim)


@pytest.mark.parametrize("coder", ["huff", "lanes", "ans"])
def test_check_streams_checks_a_layers_streams_and_names_the_one_that_fails(coder):
    import torch

    from hf_kvcompress.cache.container import check_streams
    from hf_kvcompress.codec import CodecConfig

    config = CodecConfig(coder=coder)
    blocks = [_coded_block(0, config), _coded_block(3, config)]
    check_streams(blocks, config)
    good = blocks[1].rows[0].blobs[1]
    blocks[1].rows[0].blobs[1] = b"junk" + good[4:]
    with pytest.raises(CacheFileError, match="layer 0, block at token 3, row 0, stream 1: "):
        check_streams(blocks, config)
    blocks[1].rows[0].blobs[1] = blocks[1].rows[0].blobs[0]  # a key stream where the values' is: 4 wide, not 6
    with pytest.raises(CacheFileError, match=r"block at token 3, row 0, stream 1: holds torch.bfloat16 \[4, 3\]"):
        check_streams(blocks, config)
    blocks[1].rows[0].blobs[1] = good
    blocks[0].dtype = torch.float16
    with pytest.raises(CacheFileError, match=r"block at token 0, row 0, stream 0: holds torch.bfloat16"):
        check_streams(blocks, config)
