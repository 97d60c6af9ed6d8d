"""The S3 client of the remote tier (``ocache.tiers.remote``): one bucket location, the five calls
the tier makes (create-only put, get and head of one key, streamed get, list, delete, head of the
bucket), over aiobotocore.

Why aiobotocore (docs/decisions.md D10): it runs on aiohttp like the rest of ocache, and botocore's
credential chain reads the usual AWS environment variables, ``~/.aws/credentials`` /
``~/.aws/config`` profiles and instance roles with no code here; obstore was faster on loopback
gets but reads credentials from the environment only.

A location is ``s3://bucket/prefix`` (``prefix`` may be empty); every object key the tier names is
relative to it. ``endpoint_url`` names an S3-compatible server (SeaweedFS, MinIO, Ceph RGW, R2);
None is AWS itself. The create-only put sends ``If-None-Match: *`` (S3 conditional writes, 2024;
SeaweedFS 4.48 honours it: ``tests/test_remote.py::test_create_only_put``): a second put of the same
key answers 412 and :meth:`S3Objects.put` returns False.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, AsyncIterator, BinaryIO, Callable
from urllib.parse import urlparse


#: seconds to connect to the bucket / to wait for its next byte (botocore's defaults are 60 / 60)
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0
#: a file body at least this long is put through a multipart upload (AWS refuses a single PUT over
#: 5 GB; a 128k-token state of an 8B model is ~17 GB), in parts of ``MULTIPART_PART_BYTES``
#: (S3's smallest part is 5 MiB, all but the last; at most 10,000 parts: 640 GB),
#: ``MULTIPART_CONCURRENCY`` parts in flight. Below the limit one PUT: on SeaweedFS over loopback a
#: 512 MiB file went up at 54-56 MiB/s in one PUT and 34-37 MiB/s in parts, 1 or 4 in flight
#: (scripts/bench-s3-multipart, docs/benchmarks.md 58)
MULTIPART_THRESHOLD_BYTES = 4 << 30
MULTIPART_PART_BYTES = 64 << 20
MULTIPART_CONCURRENCY = 4

#: the kinds of request :attr:`S3Objects.requests` counts: one per HTTP request the client asks
#: botocore for (each page of a listing as it is answered, each part of a multipart upload;
#: botocore's own retries of one request not counted). ``POST``: a multipart upload's create and
#: complete; ``DELETE`` includes its abort.
REQUEST_KINDS = ("LIST", "HEAD", "GET", "PUT", "POST", "DELETE")


class RemoteConfigError(ValueError):
    """``store.remote`` is malformed (the message names the key, never a credential)."""


#: where credentials come from instead of a URL (the error that refuses a URL with them says so)
CREDENTIALS_FIX = ("give them through botocore's usual chain instead: AWS_ACCESS_KEY_ID / "
                   "AWS_SECRET_ACCESS_KEY in the environment, ~/.aws/credentials, AWS_PROFILE or "
                   "store.remote.profile, an instance role")


def shown_url(url: str) -> str:
    """``url`` as it may be printed: scheme, host and path only. Userinfo (``user:secret@``)
    becomes ``***@``; a query and a fragment (a presigned URL's signature) become ``?***`` /
    ``#***``. Used by every message that names a configured URL."""
    try:
        u = urlparse(str(url))
    except ValueError:
        return "<unparsable URL>"
    host = u.netloc.rpartition("@")[2]
    out = f"{u.scheme}://{'***@' if '@' in u.netloc else ''}{host}{u.path}" if u.scheme else "<not a URL>"
    return out + ("?***" if u.query else "") + ("#***" if u.fragment else "")


def refuse_credentials(url: str, key: str) -> None:
    """Raise RemoteConfigError when ``url`` (the value of ``store.remote.<key>``) carries
    credentials (``user[:secret]@`` before the host) or a query (a presigned URL's signature);
    the message shows the URL through :func:`shown_url` and names the fix."""
    try:
        u = urlparse(str(url))
    except ValueError:
        raise RemoteConfigError(f"store.remote.{key}: not a URL") from None
    if "@" in u.netloc:
        raise RemoteConfigError(f"store.remote.{key}: {shown_url(url)} carries credentials in the URL, "
                                f"which ocache refuses (a URL is printed and logged); remove them and "
                                f"{CREDENTIALS_FIX}")
    if u.query:
        raise RemoteConfigError(f"store.remote.{key}: {shown_url(url)} has a query, which ocache refuses "
                                f"(a signature in it would be printed and logged); {CREDENTIALS_FIX}")


@dataclass(frozen=True)
class Location:
    """``s3://bucket/prefix``: ``prefix`` is empty or ends with ``/``."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, url: str) -> "Location":
        """Raises RemoteConfigError for anything but ``s3://bucket[/prefix]``: credentials in the
        URL (``s3://KEY:SECRET@bucket``) included, with a message that never shows them."""
        refuse_credentials(url, "url")
        u = urlparse(str(url))
        if u.scheme != "s3" or not u.netloc or u.fragment:
            raise RemoteConfigError(f"store.remote.url: {shown_url(url)!r} is not s3://bucket/prefix")
        prefix = u.path.strip("/")
        return cls(u.netloc, prefix + "/" if prefix else "")


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object: ``key`` relative to the location's prefix, ``size`` in bytes,
    ``modified`` Unix seconds, ``etag`` as the server gives it."""

    key: str
    size: int
    modified: float
    etag: str


def _code(exc: Exception) -> str:
    resp = getattr(exc, "response", None) or {}
    return str((resp.get("Error") or {}).get("Code") or "")


def _status(exc: Exception) -> int:
    resp = getattr(exc, "response", None) or {}
    return int((resp.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0)


class S3Objects:
    """The tier's calls on one :class:`Location` (an ``async with`` opens the client).

    Errors: botocore's ``ClientError`` (an S3 error answer) and ``BotoCoreError``/``aiohttp``
    errors (no answer) propagate, except where a method says otherwise."""

    def __init__(self, url: str, *, endpoint_url: str | None = None, region: str | None = None,
                 profile: str | None = None) -> None:
        self.location = Location.parse(url)
        if endpoint_url:
            refuse_credentials(endpoint_url, "endpoint_url")
        self.endpoint_url = endpoint_url or None
        self.region = region or None
        self.profile = profile or None
        self._stack: contextlib.AsyncExitStack | None = None
        self._client: Any = None
        self.multipart_threshold = MULTIPART_THRESHOLD_BYTES
        self.part_bytes = MULTIPART_PART_BYTES
        self.part_concurrency = MULTIPART_CONCURRENCY
        self.multipart_uploads = 0
        #: requests sent, by kind (:data:`REQUEST_KINDS`), since this object was made
        self.requests: Counter[str] = Counter()

    def _count(self, kind: str) -> None:
        """Count one request of ``kind`` (one of :data:`REQUEST_KINDS`) about to be sent."""
        self.requests[kind] += 1

    async def __aenter__(self) -> "S3Objects":
        from aiobotocore.config import AioConfig
        from aiobotocore.session import AioSession

        self._stack = contextlib.AsyncExitStack()
        session = AioSession(profile=self.profile)
        # bounded waits: a bucket that does not answer fails a sync round (retried by the next one)
        # or a download (the request goes on without it), never hangs one
        cfg = AioConfig(connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S,
                        retries={"max_attempts": 3, "mode": "standard"},
                        max_pool_connections=max(10, MULTIPART_CONCURRENCY + 4))
        self._client = await self._stack.enter_async_context(
            session.create_client("s3", endpoint_url=self.endpoint_url, region_name=self.region or "us-east-1",
                                  config=cfg))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._stack is not None:
            await self._stack.aclose()
        self._stack = self._client = None

    def _key(self, key: str) -> str:
        return self.location.prefix + key

    @property
    def client(self) -> Any:
        if self._client is None:
            raise RuntimeError("S3Objects is not open (use `async with`)")
        return self._client

    async def check(self) -> None:
        """Head the bucket (``ocache doctor``): raises ClientError (403, 404) or a connection error."""
        self._count("HEAD")
        await self.client.head_bucket(Bucket=self.location.bucket)

    async def put(self, key: str, body: bytes | BinaryIO, *, create_only: bool = False) -> bool:
        """Store ``body`` (bytes, or a binary file read from its position) under ``key``: one PUT,
        or, for a file of at least ``multipart_threshold`` bytes left, a multipart upload
        (:meth:`put_multipart`). ``create_only``: ``If-None-Match: *`` (one PUT only); False when the
        key exists already (412, or 409 for a conditional put racing another), True when stored."""
        if not create_only and not isinstance(body, (bytes, bytearray, memoryview)):
            left = os.fstat(body.fileno()).st_size - body.tell()
            if left >= self.multipart_threshold:
                await self.put_multipart(key, body, left)
                return True
        kw: dict[str, Any] = {"IfNoneMatch": "*"} if create_only else {}
        self._count("PUT")
        try:
            await self.client.put_object(Bucket=self.location.bucket, Key=self._key(key), Body=body, **kw)
        except Exception as exc:
            if create_only and (_status(exc) in (409, 412)
                                or _code(exc) in ("PreconditionFailed", "ConditionalRequestConflict")):
                return False
            raise
        return True

    async def put_multipart(self, key: str, fh: BinaryIO, size: int) -> None:
        """Store the next ``size`` bytes of ``fh`` under ``key`` through S3's multipart upload
        (aiobotocore's ``create_multipart_upload`` / ``upload_part`` /
        ``complete_multipart_upload``): parts of ``part_bytes`` (the last shorter), read in turn and
        uploaded ``part_concurrency`` at a time (so at most that many parts in memory). Any failure
        aborts the upload (nothing of it stays in the bucket, best effort) and raises."""
        import asyncio

        bucket, full = self.location.bucket, self._key(key)
        self._count("POST")
        up = await self.client.create_multipart_upload(Bucket=bucket, Key=full)
        uid = up["UploadId"]
        parts: dict[int, str] = {}
        sem = asyncio.Semaphore(max(1, self.part_concurrency))

        async def send(n: int, data: bytes) -> None:
            try:
                self._count("PUT")
                resp = await self.client.upload_part(Bucket=bucket, Key=full, UploadId=uid, PartNumber=n, Body=data)
                parts[n] = str(resp["ETag"])
            finally:
                sem.release()

        tasks: list[asyncio.Task] = []
        try:
            n, left = 0, size
            while left > 0:
                await sem.acquire()
                failed = next((t for t in tasks if t.done() and t.exception() is not None), None)
                if failed is not None:
                    sem.release()
                    raise failed.exception()  # type: ignore[misc]
                data = await asyncio.to_thread(fh.read, min(self.part_bytes, left))
                if not data:
                    sem.release()
                    raise OSError(f"{key}: the file ended {left} bytes early")
                n += 1
                left -= len(data)
                tasks.append(asyncio.create_task(send(n, data)))
            await asyncio.gather(*tasks)
            self._count("POST")
            await self.client.complete_multipart_upload(
                Bucket=bucket, Key=full, UploadId=uid,
                MultipartUpload={"Parts": [{"PartNumber": i, "ETag": parts[i]} for i in sorted(parts)]})
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(Exception):
                self._count("DELETE")
                await self.client.abort_multipart_upload(Bucket=bucket, Key=full, UploadId=uid)
            raise
        self.multipart_uploads += 1

    async def get(self, key: str) -> bytes | None:
        """The object's bytes, or None when there is no such key (one GET: :meth:`get_tagged`)."""
        got = await self.get_tagged(key)
        return None if got is None else got[0]

    async def get_tagged(self, key: str) -> tuple[bytes, str] | None:
        """The object's bytes and ETag (one GET), or None when there is no such key."""
        self._count("GET")
        try:
            resp = await self.client.get_object(Bucket=self.location.bucket, Key=self._key(key))
        except Exception as exc:
            if _status(exc) == 404 or _code(exc) in ("NoSuchKey", "404"):
                return None
            raise
        async with resp["Body"] as body:
            return bytes(await body.read()), str(resp.get("ETag", ""))

    async def head(self, key: str) -> ObjectInfo | None:
        """The object's size, modification time and ETag (one HEAD), or None when there is no such
        key."""
        self._count("HEAD")
        try:
            resp = await self.client.head_object(Bucket=self.location.bucket, Key=self._key(key))
        except Exception as exc:
            if _status(exc) == 404 or _code(exc) in ("NoSuchKey", "404", "NotFound"):
                return None
            raise
        modified = resp.get("LastModified")
        return ObjectInfo(key, int(resp.get("ContentLength") or 0),
                          modified.timestamp() if modified is not None else 0.0, str(resp.get("ETag", "")))

    async def stream(self, key: str, sink: Callable[[bytes], None], chunk: int = 1 << 20) -> int:
        """Hand the object's bytes to ``sink`` in chunks of at most ``chunk`` bytes; returns the
        bytes read. Raises FileNotFoundError when there is no such key."""
        self._count("GET")
        try:
            resp = await self.client.get_object(Bucket=self.location.bucket, Key=self._key(key))
        except Exception as exc:
            if _status(exc) == 404 or _code(exc) in ("NoSuchKey", "404"):
                raise FileNotFoundError(key) from exc
            raise
        n = 0
        async with resp["Body"] as body:
            async for part in body.iter_chunks(chunk):
                sink(part)
                n += len(part)
        return n

    async def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (relative keys), in key order."""
        out: list[ObjectInfo] = []
        async for page in self._pages(prefix):
            for o in page.get("Contents") or ():
                out.append(ObjectInfo(str(o["Key"])[len(self.location.prefix):], int(o["Size"]),
                                      o["LastModified"].timestamp(), str(o.get("ETag", ""))))
        return out

    async def _pages(self, prefix: str) -> AsyncIterator[dict]:
        pager = self.client.get_paginator("list_objects_v2")
        async for page in pager.paginate(Bucket=self.location.bucket, Prefix=self._key(prefix)):
            self._count("LIST")     # one request per page (counted as it is answered)
            yield page

    async def delete(self, key: str) -> None:
        """Delete ``key`` (no error when it is gone already: S3 answers 204 either way)."""
        self._count("DELETE")
        await self.client.delete_object(Bucket=self.location.bucket, Key=self._key(key))
