"""Runs gcp-storage-emulator (`python gcs_emulator.py PORT BUCKET [DATA_DIR]`; in memory without DATA_DIR).

Two gaps against real GCS are filled, nothing else changed:
- objects.list ignores `startOffset`/`endOffset`, which tensorstore's gcs driver sends for every list and
  `delete_range`: without them, deleting one version's keys deletes the whole bucket.
- a media download carries no `x-goog-generation` header, from which tensorstore takes the generation it
  makes a conditional write on: Orbax's OCDBT manifest, written again within one save, then fails with
  "Malformed StorageGeneration" (whether it is written twice depends on timing).
"""

from __future__ import annotations

import sys
from typing import Any

from gcp_storage_emulator import server
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects


class _Ranged:
    """The emulator's storage, listing only names in [start, end)."""

    def __init__(self, storage: Any, start: str, end: str) -> None:
        self._storage, self._start, self._end = storage, start, end

    def get_file_list(self, *args: Any, **kwargs: Any) -> tuple[list[dict[str, Any]], list[str]]:
        files, prefixes = self._storage.get_file_list(*args, **kwargs)
        inside = [f for f in files if self._start <= f["name"] and (not self._end or f["name"] < self._end)]
        return inside, prefixes


def _ls(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> None:
    start, end = (request.query.get(name, [""])[0] for name in ("startOffset", "endOffset"))
    objects.ls(request, response, _Ranged(storage, start, end), *args, **kwargs)


def _download(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> None:
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        response["x-goog-generation"] = obj["generation"]
        response["x-goog-metageneration"] = obj["metageneration"]
    except NotFound:
        pass  # the download answers 404 itself
    _emulator_download(request, response, storage, *args, **kwargs)


_emulator_download = objects.download


def main(port: int, bucket: str, data_dir: str | None = None) -> None:
    objects.download = _download  # objects.get calls it for `alt=media` too
    ours = {_emulator_download: _download, objects.ls: _ls}
    server.HANDLERS = tuple(
        (regex, {method: ours.get(handler, handler) for method, handler in handlers.items()})
        for regex, handlers in server.HANDLERS
    )
    server.create_server("127.0.0.1", port, in_memory=data_dir is None, default_bucket=bucket, data_dir=data_dir).run()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], *sys.argv[3:])
