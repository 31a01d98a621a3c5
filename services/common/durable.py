"""The durable copy of an adapter version in the object store, as its readers get it.

`<run>/adapters/v<N>/adapter_model.safetensors` is what every replica outside the XCCL group,
the exporter and any late joiner reads. Beside it, `announced.sha256` takes the version's
number before the event goes out (the store is the ledger of taken numbers).

Invariant: a reader only ever returns bytes whose sha256 the trainer computed from the weights
it announced. Either the event carries that sha256 (the object path: stored, then announced),
or the event left it out (XCCL: the event goes out as soon as the broadcast is done, and the
copy is serialised and hashed behind it); then the marker holds `pending` until the object is
stored and the sha256 after, so "marker holds a digest" implies "object complete".
"""

from __future__ import annotations

import re

from proto.messages import ObjectPayload
from services.common import adapter_io
from services.common.store import ObjectNotFound, ObjectStore

ANNOUNCED_NAME = "announced.sha256"
PENDING = b"pending"
"""the marker's content between the event and the stored object"""
_DIGEST = re.compile(rb"^[0-9a-f]{64}$")


def adapter_key(run: str, version: int) -> str:
    return f"{run}/adapters/v{version}/{adapter_io.WEIGHTS_NAME}"


def announced_key(run: str, version: int) -> str:
    return f"{run}/adapters/v{version}/{ANNOUNCED_NAME}"


def marker_uri(object_uri: str) -> str:
    """The `announced.sha256` beside an object's uri."""
    return f"{object_uri.rsplit('/', 1)[0]}/{ANNOUNCED_NAME}"


def stored_digest(store: ObjectStore, object_uri: str) -> str | None:
    """The sha256 the marker beside `object_uri` holds once the object is stored; None while
    it is pending or absent."""
    try:
        raw = store.get_bytes(marker_uri(object_uri)).strip()
    except ObjectNotFound:
        return None
    return raw.decode() if _DIGEST.match(raw) else None


def read(store: ObjectStore, obj: ObjectPayload) -> bytes:
    """The object's bytes, verified against the event's sha256 or, when the event has none,
    the stored one. Raises `ObjectNotFound` while the object is not complete yet (wrap in
    `xccl.fetch_when_stored` to wait for it)."""
    sha = obj.sha256
    if sha is None:
        sha = stored_digest(store, obj.uri)
        if sha is None:
            raise ObjectNotFound(f"{obj.uri}: announced, its durable copy not stored yet")
    return store.get_bytes(obj.uri, sha256=sha, size=obj.bytes)
