"""The remote tier's transfers against a real SeaweedFS on loopback (``s3_bucket``,
tests/conftest.py): big objects through S3's multipart upload (a lowered part size stands in for
the 64 MiB parts of a 17 GB state), a failed part aborting its upload, and one entry the bucket
refuses not stopping the others. Requests are counted at the S3 client (botocore's ``before-call``
event). No llama-server: entries are written in the server's layout (``tests/test_store.py``).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from types import SimpleNamespace

from ocache.llama.flags import ServerParams
from ocache.tiers.remote import RemoteTier
from ocache.tiers.remote_bucket import DATA, RECORDS
from ocache.tiers.remote_client import S3Objects
from test_remote import TOKS, host, listed
from test_store import put

MIB = 1 << 20


def count_ops(objects: S3Objects) -> Counter:
    ops: Counter = Counter()

    def before_call(model, **kw):
        ops[model.name] += 1

    objects.client.meta.events.register("before-call.s3", before_call)
    return ops


def lowered(objects: S3Objects, part: int = 5 * MIB) -> None:
    """Multipart from ``part`` bytes on, in parts of ``part`` bytes (5 MiB: S3's smallest part but
    the last, which SeaweedFS enforces too; ocache's own is 64 MiB)."""
    objects.multipart_threshold = objects.part_bytes = part


async def test_a_big_object_goes_up_in_parts_and_comes_back_whole(tmp_path, s3_bucket):
    from ocache.tiers.remote import RemoteSettings

    src = tmp_path / "big.bin"
    data = os.urandom(6 * 5 * MIB + 12345)              # six parts and a tail
    src.write_bytes(data)
    async with RemoteSettings(**s3_bucket).objects() as o:
        lowered(o)
        ops = count_ops(o)
        with open(src, "rb") as fh:
            assert await o.put("data/big", fh)
        assert ops == Counter({"CreateMultipartUpload": 1, "UploadPart": 7, "CompleteMultipartUpload": 1})
        assert o.multipart_uploads == 1 and await o.get("data/big") == data
        small = tmp_path / "small.bin"
        small.write_bytes(data[:5 * MIB - 1])
        ops.clear()
        with open(small, "rb") as fh:
            assert await o.put("data/small", fh)           # below the threshold: one PUT
        assert ops == Counter({"PutObject": 1})


async def test_a_failed_part_aborts_its_upload_and_leaves_nothing(tmp_path, s3_bucket):
    from ocache.tiers.remote import RemoteSettings

    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(25 * MIB))
    async with RemoteSettings(**s3_bucket).objects() as o:
        lowered(o)
        real = o.client.upload_part
        seen = []

        async def flaky(**kw):
            seen.append(kw["PartNumber"])
            if kw["PartNumber"] == 3:
                raise ConnectionResetError("part 3 lost")
            return await real(**kw)

        o.client.upload_part = flaky
        ops = count_ops(o)
        with open(src, "rb") as fh:
            try:
                await o.put("data/big", fh)
                raise AssertionError("the put did not fail")
            except ConnectionResetError:
                pass
        assert ops["AbortMultipartUpload"] == 1 and ops["CompleteMultipartUpload"] == 0
        assert await o.get("data/big") is None
        up = await o.client.list_multipart_uploads(Bucket=o.location.bucket)
        assert not up.get("Uploads"), up


async def test_an_entry_of_many_parts_is_uploaded_and_fetched_verified(tmp_path, s3_bucket):
    sa, oa, ba = host(tmp_path, "A", s3_bucket)
    sb, ob, bb = host(tmp_path, "B", s3_bucket)
    async with oa, ob:
        lowered(oa)
        e = put(sa, TOKS, state_bytes=11 * MIB, kind="a")
        assert await ba.upload(e)
        assert oa.multipart_uploads == 1                    # the .bin; the small .ckpt in one PUT
        got = await bb.fetch(e.key)
        assert got.files["bin"].xxh3 == e.files["bin"].xxh3 and got.files["bin"].size == e.files["bin"].size


async def test_an_entry_the_bucket_refuses_does_not_stop_the_others(tmp_path, s3_bucket):
    """The bucket refuses every object of one entry (403, as a bucket policy or a size limit
    would). A sync round uploads the other entries, counts the refusal, and tries the refused
    entry again only after its backoff; once the bucket takes it, it is uploaded."""
    import botocore.exceptions

    from ocache.tiers import remote as remote_mod

    sa, oa, ba = host(tmp_path, "A", s3_bucket)
    async with oa:
        es = [put(sa, [30 + i] * 60, state_bytes=20_000, kind="a", seed=i) for i in range(4)]
        refused = es[1].key
        real = oa.put
        tried = []

        async def put_refusing(key, body, *, create_only=False):
            if refused in key:
                tried.append(key)
                raise botocore.exceptions.ClientError(
                    {"Error": {"Code": "AccessDenied", "Message": "refused"},
                     "ResponseMetadata": {"HTTPStatusCode": 403}}, "PutObject")
            return await real(key, body, create_only=create_only)

        oa.put = put_refusing
        ta = RemoteTier(ba, SimpleNamespace(params=ServerParams()))
        assert await ta.sync(refresh=True) == 3
        records = await listed(oa, RECORDS)
        assert {k[len(RECORDS):-5] for k in records} == {e.key for e in es} - {refused}
        assert ba.counters["upload_failed"] == 1 and len(tried) == 1
        assert not any(refused in k for k in await listed(oa, DATA))

        assert await ta.sync(refresh=True) == 0             # within its backoff: not tried again
        assert len(tried) == 1 and ba.counters["upload_failed"] == 1
        assert ta._retry[refused][1] - time.monotonic() > remote_mod.UPLOAD_RETRY_FIRST_S - 1
        ta._retry[refused] = (ta._retry[refused][0], 0.0)   # its backoff has passed
        assert await ta.sync(refresh=True) == 0             # tried, refused again, counted
        assert len(tried) == 2 and ba.counters["upload_failed"] == 2
        fails, _ = ta._retry[refused]
        assert fails == 2                                   # its wait doubled
        oa.put = real                                       # the bucket takes it now
        assert ta._retry[refused][1] - time.monotonic() > 2 * remote_mod.UPLOAD_RETRY_FIRST_S - 1
        ta._retry[refused] = (ta._retry[refused][0], 0.0)
        assert await ta.sync(refresh=True) == 1
        assert refused in ba.index and refused not in ta._retry
