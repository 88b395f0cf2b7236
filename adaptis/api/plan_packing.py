"""The packed wire form of a plan's actions: what lets any plan fit a Kubernetes ConfigMap.

Sits in the api layer beside :mod:`adaptis.api.plan`, whose :class:`~adaptis.api.plan.Plan`
stays the only model of a plan: a plan document may carry its per-device actions either as the
plain ``actions`` lists or as the string ``actionsPacked`` made here, and ``Plan`` reads both
(the operator writes the packed form into the job's ConfigMap, ``adaptis plan --save-plan``
the plain one). A 64-rank x 4096-microbatch plan is 7.4 MB as plain JSON and 1.3 MB gzipped,
over the ConfigMap's 1 MiB; packed it is a few tens of kB (figures in docs/plan-storage.md).

Layout (version 1), before zlib and base64: ``b"APK1"``, then little-endian uint32 columns:
device count, action count, each device's action count, then one byte per action (its kind),
each action's stage, and each action's microbatch as the zigzag-coded difference from the one
expected next for that (kind, stage) on that device, the previous one plus one. Every schedule
runs each stage's microbatches mostly in order, so that column is nearly all zeros and the
columns repeat: zlib squeezes them to almost nothing while any order stays representable.
"""

from __future__ import annotations

import base64
import binascii
import sys
import zlib
from array import array
from collections.abc import Sequence

__all__ = ["PACKED_PREFIX", "PackingError", "pack_actions", "unpack_actions"]

#: Every packed string starts with this (so a reader can tell a packed plan of a later version).
PACKED_PREFIX = "apk1:"
_MAGIC = b"APK1"
_KINDS = ("F", "B", "W", "BW")
_CODE = {k: i for i, k in enumerate(_KINDS)}
# The decompressed size a packed plan may claim: 4096 ranks x 4096 microbatches x 3 actions x
# 9 bytes is 450 MiB; anything above is not a plan this project makes.
_MAX_RAW = 1 << 29


class PackingError(ValueError):
    """A packed string that is not one this module wrote (a ValueError, so pydantic reports it
    on the field)."""


def _u32(values: Sequence[int] | array) -> bytes:  # type: ignore[type-arg]
    col = array("I", values)
    if sys.byteorder == "big":
        col.byteswap()
    return col.tobytes()


def _from_u32(raw: bytes) -> array:  # type: ignore[type-arg]
    col = array("I")
    col.frombytes(raw)
    if sys.byteorder == "big":
        col.byteswap()
    return col


def pack_actions(actions: Sequence[Sequence[tuple[str, int, int]]]) -> str:
    """``actions[d]`` (device d's ``(kind, stage, microbatch)`` in order) as one ASCII string."""
    counts = [len(acts) for acts in actions]
    kinds = bytearray()
    stages: array = array("I")  # type: ignore[type-arg]
    deltas: array = array("I")  # type: ignore[type-arg]
    for acts in actions:
        expected: dict[tuple[int, int], int] = {}
        for kind, stage, mb in acts:
            code = _CODE[kind]
            key = (code, stage)
            diff = mb - expected.get(key, 0)
            expected[key] = mb + 1
            kinds.append(code)
            stages.append(stage)
            deltas.append(diff * 2 if diff >= 0 else -diff * 2 - 1)
    raw = b"".join((_MAGIC, _u32([len(actions), len(kinds)]), _u32(counts), bytes(kinds),
                    _u32(stages), _u32(deltas)))
    return PACKED_PREFIX + base64.b64encode(zlib.compress(raw, 9)).decode("ascii")


def unpack_actions(text: str) -> list[list[tuple[str, int, int]]]:
    """The inverse of :func:`pack_actions`; :class:`PackingError` on anything it did not write."""
    if not text.startswith(PACKED_PREFIX):
        raise PackingError(f"not a packed plan (expected the prefix {PACKED_PREFIX!r}; a newer "
                           "operator may have written it)")
    try:
        inflater = zlib.decompressobj()
        raw = inflater.decompress(base64.b64decode(text[len(PACKED_PREFIX):], validate=True),
                                  _MAX_RAW)
    except (binascii.Error, zlib.error) as err:
        raise PackingError(f"corrupt packed plan: {err}") from None
    if inflater.unconsumed_tail:
        raise PackingError(f"packed plan larger than {_MAX_RAW} bytes unpacked")
    if raw[:4] != _MAGIC or len(raw) < 12:
        raise PackingError("corrupt packed plan: bad header")
    devices, total = _from_u32(raw[4:12])
    need = 12 + 4 * devices + total * 9
    if len(raw) != need:
        raise PackingError(f"corrupt packed plan: {len(raw)} bytes, the header implies {need}")
    pos = 12
    counts = _from_u32(raw[pos:pos + 4 * devices])
    pos += 4 * devices
    kinds = raw[pos:pos + total]
    pos += total
    stages = _from_u32(raw[pos:pos + 4 * total])
    deltas = _from_u32(raw[pos + 4 * total:])
    if sum(counts) != total or (total and max(kinds) >= len(_KINDS)):
        raise PackingError("corrupt packed plan: action counts or kinds out of range")
    out: list[list[tuple[str, int, int]]] = []
    i = 0
    for count in counts:
        expected: dict[tuple[int, int], int] = {}
        acts: list[tuple[str, int, int]] = []
        for j in range(i, i + count):
            code, stage, z = kinds[j], stages[j], deltas[j]
            key = (code, stage)
            mb = expected.get(key, 0) + ((z >> 1) if not z & 1 else -((z + 1) >> 1))
            expected[key] = mb + 1
            acts.append((_KINDS[code], stage, mb))
        out.append(acts)
        i += count
    return out
