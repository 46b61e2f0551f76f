"""Helpers for tests that take saved cache files apart: split a file into header and payload, and seal
(re-checksum) an edited one, so that the loader's structural checks are exercised behind the checksum."""

from __future__ import annotations

import hashlib
import json
import struct

from hf_kvcompress.cache.persist import MAGIC, VERSION

DIGEST = 32
PREFIX = struct.Struct("<8sII")  # magic, version, header length: the format, written down here independently


def split(data: bytes) -> tuple[dict, bytes]:
    """(header, payload) of an intact version-2 file."""
    _magic, _version, size = PREFIX.unpack_from(data, 0)
    return json.loads(data[PREFIX.size : PREFIX.size + size]), data[PREFIX.size + size : -DIGEST]


def seal(header: dict | bytes, payload: bytes, version: int = VERSION) -> bytes:
    """A file of ``header`` (a dict, or raw header bytes) and ``payload`` with a valid checksum."""
    blob = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    body = MAGIC + struct.pack("<II", version, len(blob)) + blob + payload
    return body + hashlib.sha256(body).digest()


def reseal(data: bytes) -> bytes:
    """``data`` with its trailing checksum recomputed (what a deliberate edit would do)."""
    return data[:-DIGEST] + hashlib.sha256(data[:-DIGEST]).digest()


def byte_classes(data: bytes) -> dict[str, list[tuple[int, int]]]:
    """Byte ranges of each part of a file: magic, version, header length, header, each block's streams,
    side data and the checksum."""
    header, _payload = split(data)
    base = len(data) - DIGEST - header["payload_bytes"]
    classes: dict[str, list[tuple[int, int]]] = {
        "magic": [(0, 8)], "version": [(8, 12)], "header_length": [(12, 16)], "header": [(16, base)],
        "checksum": [(len(data) - DIGEST, len(data))], "side": [],
    }
    for entry in header["layers"]:
        for block in entry["blocks"]:
            name = f"streams L{entry['layer']} @{block['start']}"
            for row in block["rows"]:
                classes.setdefault(name, []).extend((base + o, base + o + n) for o, n in row["streams"])
                classes["side"].extend((base + i["offset"], base + i["offset"] + i["bytes"]) for i in row["side"].values())
    return classes
