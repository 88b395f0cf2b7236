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

Decoding is bounded before anything is allocated: the header (device and action counts) is
inflated first and checked against :class:`PackLimits` (by default the CRD's maxima; a reader
that knows the job passes its own, far smaller ones), and only then exactly the bytes the header
implies. A packed string is a few hundred kB at most but may claim hundreds of MB unpacked (a
decompression bomb); that claim is refused from its first 12 bytes.
"""

from __future__ import annotations

import base64
import binascii
import sys
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["CRD_LIMITS", "PACKED_PREFIX", "PackLimits", "PackingError", "pack_actions",
           "unpack_actions"]

#: Every packed string starts with this (so a reader can tell a packed plan of a later version).
PACKED_PREFIX = "apk1:"
_MAGIC = b"APK1"
_KINDS = ("F", "B", "W", "BW")
_CODE = {k: i for i, k in enumerate(_KINDS)}
_HEADER = 12  # magic, device count, action count


@dataclass(frozen=True, slots=True)
class PackLimits:
    """The most devices and actions a packed plan may claim before it is inflated."""

    max_devices: int
    max_actions: int

    @classmethod
    def of(cls, *, devices: int, stages: int, microbatches: int) -> PackLimits:
        """A plan over ``devices`` of at most ``stages`` stages: each (stage, microbatch) has
        an F, a B and a W at most."""
        return cls(max_devices=devices, max_actions=3 * stages * microbatches)

    def raw_bytes(self) -> int:
        return _HEADER + 4 * self.max_devices + 9 * self.max_actions


#: The CRD's maxima: 128 workers x 16 GPUs of pipeline ranks, 4096 microbatches, and a stage
#: per layer at most (4096 blocks, the embedding and the head). A reader that knows the job
#: passes :meth:`PackLimits.of` its spec's figures instead.
CRD_LIMITS = PackLimits.of(devices=128 * 16, stages=4096 + 2, microbatches=4096)


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


def unpack_actions(text: str, *, limits: PackLimits = CRD_LIMITS) -> list[list[tuple[str, int, int]]]:
    """The inverse of :func:`pack_actions`; :class:`PackingError` on anything it did not write
    or that claims more than ``limits``, found before the body is inflated."""
    if not text.startswith(PACKED_PREFIX):
        raise PackingError(f"not a packed plan (expected the prefix {PACKED_PREFIX!r}; a newer "
                           "operator may have written it)")
    # A packed string is base64 of zlib of at most limits.raw_bytes(); zlib's ratio is at
    # most ~1032:1, so a longer text is not a plan within the limits either.
    if len(text) > 2 * limits.raw_bytes() + 64:
        raise PackingError(f"packed plan of {len(text)} characters, longer than any plan within "
                           f"{limits.max_devices} devices and {limits.max_actions} actions")
    try:
        inflater = zlib.decompressobj()
        body = base64.b64decode(text[len(PACKED_PREFIX):], validate=True)
        head = inflater.decompress(body, _HEADER)
        if head[:4] != _MAGIC or len(head) < _HEADER:
            raise PackingError("corrupt packed plan: bad header")
        devices, total = _from_u32(head[4:_HEADER])
        if devices > limits.max_devices or total > limits.max_actions:
            raise PackingError(
                f"packed plan claims {devices} devices and {total} actions, over the "
                f"{limits.max_devices} devices and {limits.max_actions} actions it may have")
        need = _HEADER + 4 * devices + total * 9
        # One byte more than the header implies, to see a longer body without inflating it.
        raw = head + inflater.decompress(inflater.unconsumed_tail, need - _HEADER + 1)
    except (binascii.Error, zlib.error) as err:
        raise PackingError(f"corrupt packed plan: {err}") from None
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
