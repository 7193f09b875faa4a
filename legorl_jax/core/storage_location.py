"""Where a run keeps state that may live on a local file system or in a GCS bucket: a plain path or
`gs://bucket/prefix`. A URL is never mistaken for a relative path (`Path("gs://b/x")` is `gs:/b/x`, a
local directory): a malformed one, or another scheme's, is refused.
"""

from __future__ import annotations

import re

GCS_SCHEME = "gs://"
# GCS bucket names: 3-63 lowercase letters, digits, '-', '_', '.', starting and ending alphanumeric.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]")
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def is_gcs(location: str) -> bool:
    return location.startswith(GCS_SCHEME)


def checked_location(location: str) -> str:
    """`location` when it is a local path, or a well-formed `gs://bucket[/prefix]` without trailing
    slashes; ValueError saying what is wrong otherwise."""
    if not location:
        raise ValueError("empty: give a local path or gs://bucket/prefix")
    if location[:3].lower() == "gs:":
        return _checked_gcs(location)
    if _URL.match(location):
        raise ValueError(f"{location!r}: only a local path or gs://bucket/prefix is supported")
    return location


def _checked_gcs(url: str) -> str:
    if not url.startswith(GCS_SCHEME):
        raise ValueError(f"{url!r} is not a gs:// URL: write gs://bucket/prefix")
    bucket, _, prefix = url[len(GCS_SCHEME) :].rstrip("/").partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise ValueError(f"{url!r}: {bucket!r} is not a GCS bucket name (3-63 of a-z 0-9 - _ .)")
    # An empty or dot segment names no object prefix GCS would list back the same way.
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise ValueError(f"{url!r}: the prefix has an empty, '.' or '..' segment")
    return f"{GCS_SCHEME}{bucket}/{prefix}" if prefix else f"{GCS_SCHEME}{bucket}"
