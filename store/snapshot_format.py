"""A safe, versioned format for the state hosts read back from the store.

Snapshots of a step processor (and the inputs of retained steps) are written to the store
and read back after a restart; whoever can write the store must not be able to run code in
the worker by crafting one (pickle would let them). The format holds data only:

- a zip archive (numpy's .npz) whose `__tree__` member is UTF-8 JSON describing the
  state's structure, and one `.npy` member per numpy array or bytes value;
- it is read with `numpy.load(allow_pickle=False)`, so no object array is ever unpickled;
- the JSON tags the few non-JSON values: tuples, dicts with non-string keys, sets, numpy
  arrays and scalars (exact dtype and bits), bytes, encoded op batches (`RankStepBatch`,
  their own checksummed wire format), and the dataclasses of a dependency model, built
  only from the fixed list in `_DATACLASSES` with their declared fields.

Anything else is refused when writing (TypeError) and reading (`SnapshotError`).
"""

from __future__ import annotations

import dataclasses
import io
import json
import zipfile
from typing import Any

import numpy as np

from lagscope.producers.events import RankStepBatch, SchemaError, decode_batch
from lagscope.simulator.depmodel import CommGroup, DependencyModel, OpName

#: Written into every payload; a reader refuses other versions.
FORMAT = "lagscope-state/1"

_TREE = "__tree__"
_DATACLASSES: dict[str, type] = {cls.__name__: cls for cls in (OpName, CommGroup, DependencyModel)}


class SnapshotError(ValueError):
    """A payload that is not a state this version can read (corrupt, foreign or crafted)."""


def encode_state(tree: Any) -> bytes:
    """The payload of `tree` (dicts, lists, tuples, sets, scalars, numpy arrays, bytes,
    op batches and dependency models)."""
    arrays: dict[str, np.ndarray] = {}
    document = {"format": FORMAT, "tree": _encode(tree, arrays)}
    arrays[_TREE] = np.frombuffer(
        json.dumps(document, separators=(",", ":")).encode(), dtype=np.uint8
    )
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def decode_state(payload: bytes, where: str = "state") -> Any:
    """The tree `encode_state` wrote; anything else is a SnapshotError naming `where`."""
    try:
        with np.load(io.BytesIO(payload), allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
        document = json.loads(arrays.pop(_TREE).tobytes())
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as exc:
        raise SnapshotError(f"{where}: not a lagscope state payload ({exc})") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        found = document.get("format") if isinstance(document, dict) else None
        raise SnapshotError(f"{where}: state format {found!r}, this version reads {FORMAT}")
    try:
        return _decode(document["tree"], arrays)
    except (KeyError, TypeError, ValueError, IndexError, SchemaError) as exc:
        raise SnapshotError(f"{where}: malformed state ({exc!r})") from None


def _encode(value: Any, arrays: dict[str, np.ndarray]) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        if isinstance(value, float) and not np.isfinite(value):
            return {"$float": repr(value)}
        return value
    if isinstance(value, list):
        return [_encode(v, arrays) for v in value]
    if isinstance(value, tuple):
        return {"$tuple": [_encode(v, arrays) for v in value]}
    if isinstance(value, dict):
        return {"$dict": [[_encode(k, arrays), _encode(v, arrays)] for k, v in value.items()]}
    if isinstance(value, set | frozenset):
        tag = "$frozenset" if isinstance(value, frozenset) else "$set"
        return {tag: [_encode(v, arrays) for v in sorted(value, key=repr)]}
    if isinstance(value, np.ndarray | np.generic):
        array = np.asarray(value)
        if array.dtype.hasobject:
            raise TypeError("object arrays cannot be stored in a state payload")
        return {"$array": _store(arrays, array), "scalar": isinstance(value, np.generic)}
    if isinstance(value, bytes | bytearray | memoryview):
        return {"$bytes": _store(arrays, np.frombuffer(bytes(value), dtype=np.uint8))}
    if isinstance(value, RankStepBatch):
        return {"$batch": _store(arrays, np.frombuffer(value.encode(), dtype=np.uint8))}
    name = type(value).__name__
    if dataclasses.is_dataclass(value) and _DATACLASSES.get(name) is type(value):
        fields = {
            f.name: _encode(getattr(value, f.name), arrays) for f in dataclasses.fields(value)
        }
        return {"$dataclass": name, "fields": fields}
    raise TypeError(f"{type(value).__qualname__} cannot be stored in a state payload")


def _store(arrays: dict[str, np.ndarray], array: np.ndarray) -> str:
    name = f"a{len(arrays)}"
    arrays[name] = array
    return name


def _decode(value: Any, arrays: dict[str, np.ndarray]) -> Any:
    if isinstance(value, list):
        return [_decode(v, arrays) for v in value]
    if not isinstance(value, dict):
        return value
    if "$array" in value:
        array = arrays[value["$array"]]
        return array[()] if value.get("scalar") else array
    if "$tuple" in value:
        return tuple(_decode(v, arrays) for v in value["$tuple"])
    if "$dict" in value:
        return {_decode(k, arrays): _decode(v, arrays) for k, v in value["$dict"]}
    if "$set" in value:
        return {_decode(v, arrays) for v in value["$set"]}
    if "$frozenset" in value:
        return frozenset(_decode(v, arrays) for v in value["$frozenset"])
    if "$float" in value:
        return float(value["$float"])
    if "$bytes" in value:
        return arrays[value["$bytes"]].tobytes()
    if "$batch" in value:
        return decode_batch(arrays[value["$batch"]].tobytes(), where="snapshot")
    if "$dataclass" in value:
        cls = _DATACLASSES[value["$dataclass"]]  # only the listed classes, nothing else
        declared = {f.name for f in dataclasses.fields(cls)}
        # A field added since the payload was written takes its default.
        required = {
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        fields = value["fields"]
        if not required <= set(fields) <= declared:
            raise ValueError(f"{cls.__name__} fields {sorted(fields)} != {sorted(declared)}")
        return cls(**{name: _decode(v, arrays) for name, v in fields.items()})
    raise ValueError(f"unknown tag in {sorted(value)[:3]}")
