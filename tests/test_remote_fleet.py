"""The remote tier for a fleet of hosts: what a URL may carry, records of a newer layout, signed
records, and how long a request waits for the bucket. Bucket tests run against a real SeaweedFS on
loopback (``s3_bucket``, tests/conftest.py; hosts as in tests/test_remote.py); faults a real S3
server cannot produce (a bucket that never answers) come from a stand-in objects class.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import yaml

from ocache import config as cfg_mod
from ocache.tiers.remote import RemoteSettings, check_remote, open_remote_tier
from ocache.tiers.remote_client import Location, RemoteConfigError, S3Objects

KEY_ID = "AKIAFLEETTESTKEYID"
SECRET = "wJalrXUtnFEMI-s3cr3t-K7MDENG"


# ---------------------------------------------------------------------- credentials in URLs
@pytest.mark.parametrize("url", [f"s3://{KEY_ID}:{SECRET}@bkt/ocache", f"s3://{SECRET}@bkt",
                                 f"s3://bkt/ocache?X-Amz-Signature={SECRET}"])
def test_a_url_with_credentials_is_refused_without_showing_them(url):
    for call in (lambda: Location.parse(url), lambda: S3Objects(url)):
        with pytest.raises(RemoteConfigError) as err:
            call()
        msg = str(err.value)
        assert SECRET not in msg and KEY_ID not in msg
        assert msg.startswith("store.remote.url") and "AWS_SECRET_ACCESS_KEY" in msg
    with pytest.raises(cfg_mod.ConfigError) as err:
        cfg_mod.check_store({"remote": {"url": url}})
    assert SECRET not in str(err.value) and "AWS_ACCESS_KEY_ID" in str(err.value)


def test_an_endpoint_with_credentials_is_refused_and_a_plain_one_is_kept():
    with pytest.raises(cfg_mod.ConfigError) as err:
        cfg_mod.check_store({"remote": {"url": "s3://bkt", "endpoint_url": f"http://{KEY_ID}:{SECRET}@s3.internal:8333"}})
    assert SECRET not in str(err.value) and "store.remote.endpoint_url" in str(err.value)
    assert S3Objects("s3://bkt/p", endpoint_url="http://s3.internal:8333").endpoint_url == "http://s3.internal:8333"
    with pytest.raises(cfg_mod.ConfigError) as err:   # a URL given where the mapping belongs
        cfg_mod.check_store({"remote": f"s3://{KEY_ID}:{SECRET}@bkt"})
    assert SECRET not in str(err.value)


async def test_the_check_and_the_tier_refuse_a_url_with_credentials_without_showing_them(caplog):
    """A Config built in code skips ``check_store``: the doctor's check and the tier still refuse."""
    caplog.set_level(logging.DEBUG)
    cfg = cfg_mod.Config(store={"remote": {"url": f"s3://{KEY_ID}:{SECRET}@bkt/p", "endpoint_url": "http://127.0.0.1:9"}})
    got = await check_remote(cfg)
    assert got is not None and got[0] is False and SECRET not in got[1] and "credentials" in got[1]
    with pytest.raises(RemoteConfigError) as err:
        await open_remote_tier(cfg, None, None)   # refused before the store or the table is read
    assert SECRET not in str(err.value)
    assert SECRET not in caplog.text and KEY_ID not in caplog.text


def test_doctor_refuses_a_url_with_credentials_and_prints_no_secret(tmp_path):
    cfg = tmp_path / "ocache.yaml"
    cfg.write_text(yaml.safe_dump({"store": {"remote": {"url": f"s3://{KEY_ID}:{SECRET}@bkt/ocache",
                                                        "endpoint_url": "http://127.0.0.1:9"}}}))
    slots = tmp_path / "slots"
    slots.mkdir()
    out = subprocess.run([sys.executable, "-m", "ocache", "doctor", "--offline", "--config", str(cfg), "--",
                          "-m", "x.gguf", "--slot-save-path", str(slots)],
                         capture_output=True, text=True, timeout=120, env=dict(os.environ))
    text = out.stdout + out.stderr
    assert SECRET not in text and KEY_ID not in text, text
    line = next((ln for ln in out.stdout.splitlines() if "store.remote" in ln), "")
    assert "[error] store.remote.url" in line and "credentials" in line, text
    assert out.returncode == 1, text
