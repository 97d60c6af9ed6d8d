"""ocache configuration: one validated ``Config``, read once at start.

Precedence (later wins): built-in defaults < ``ocache.yaml`` < environment ``OCACHE_<KEY>`` <
command-line flags. The YAML file is the one given with ``--config`` (or ``$OCACHE_CONFIG``), else
``./ocache.yaml`` if it exists. The schema is the ``Config`` dataclass below: each field's
``doc`` metadata documents it (``ocache serve --help-config`` prints the table).

Environment values are strings and are converted by the field's type: booleans accept
``1/0/true/false/yes/no/on/off``; lists are comma-separated (``OCACHE_ALLOWED_HOSTS=a.lan,b.lan``);
``OCACHE_TIERS`` and ``OCACHE_LAUNCH`` take YAML (``OCACHE_LAUNCH='[-m, /m.gguf]'``).
Environment variables that are not config keys (``OCACHE_CACHE_DIR`` is one; ``OCACHE_SHARED``
used by the tests is not) are ignored, because other ocache tools share the prefix; one that nearly
spells a key (``OCACHE_ADMIN_TOKN``) is ignored with a warning. Unknown keys in
the YAML file and bad values anywhere raise ``ConfigError`` naming the key and the source.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(ValueError):
    """A config key is unknown or a value is invalid; the message names the key and its source."""


def _f(default: Any, doc: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        def fresh() -> Any:  # a copy per Config, of the same type
            return type(default)(default)
        return field(default_factory=fresh, metadata={"doc": doc, **kw})
    return field(default=default, metadata={"doc": doc, **kw})


@dataclass
class Config:
    """The ocache configuration schema (YAML keys = field names; env = ``OCACHE_`` + upper name)."""

    host: str = _f("127.0.0.1", "address to listen on; loopback by default, anything else is an "
                   "explicit choice (the proxy has no client authentication)")
    port: int = _f(8081, "TCP port to listen on (1-65535; 0: any free port, logged)", min=0, max=65535)
    upstream: str = _f("http://127.0.0.1:8080", "base URL of llama-server (http://host:port); with "
                       "`launch`, the launched server's URL replaces it")
    upstreams: list[str] = _f([], "several llama-servers of one model behind one ocache (one per "
                              "GPU or host): their base URLs; the router picks one per request by "
                              "usable prefix and load (ocache/router.py); unset: `upstream` alone")
    route_policy: str = _f("prefix", "with several servers: `prefix` (least expected work: prefill "
                           "the server's cache leaves + its load) or `round_robin` (for comparisons)",
                           choices=("prefix", "round_robin"))
    route_load_weight: float = _f(0.5, "with several servers: seconds of load a request in flight "
                                  "adds, as a fraction of the server's mean request time (the "
                                  "router's beta)", min=0)
    upstream_api_key: str | None = _f(None, "API key ocache itself uses for its probes of a server "
                                      "started with --api-key (/metrics, /props, /slots); clients' "
                                      "own Authorization headers are always forwarded as they are")
    admin_token: str | None = _f(None, "bearer token for POST /v1/cache/clear, /warm and /drain "
                                 "(unset = those routes answer 404) and for the session ids in "
                                 "GET /v1/cache/stats (ocache/admin.py)")
    allowed_hosts: list[str] = _f([], "extra Host header names accepted (DNS-rebinding guard); "
                                  "localhost, 127.0.0.1, ::1 and the bound host are always "
                                  "accepted; '*' accepts any")
    cache_dir: str | None = _f(None, "root of ocache's private state (store/: anchors and spills; "
                               "journal/); unset: $OCACHE_STATE_DIR, else ~/.cache/ocache "
                               "(ocache/paths.py); its env form OCACHE_CACHE_DIR also moves the "
                               "build cache")
    log_level: str = _f("info", "logging level: debug, info, warning or error", choices=LOG_LEVELS)
    max_body_mb: float = _f(512.0, "largest request body accepted, in MiB (a 130k-token prompt "
                            "is a few MB)", min=0.001)
    retry_after_s: int = _f(2, "Retry-After seconds in the 503 answered while the upstream is down",
                            min=0)
    probe_interval_s: float = _f(2.0, "seconds between upstream identity probes while it is up "
                                 "(restart detection); while it is down, probes run every 0.25 s",
                                 min=0.05)
    drain_timeout_s: float = _f(60.0, "on SIGTERM, seconds to wait for in-flight requests, then at most as long for the spills (abandoned at once when llama-server goes down)", min=0)
    upstream_read_timeout_s: float = _f(1800.0, "a non-streamed forward fails with 504 when the "
                                        "upstream sends no byte for this many seconds (its whole "
                                        "prefill + generation: the default allows a 30-minute "
                                        "prefill)", min=0.1)
    stream_idle_timeout_s: float = _f(1800.0, "a streamed (SSE) forward is cut when the upstream "
                                      "sends no chunk for this many seconds (the first chunk comes "
                                      "after the prefill: the default allows a 30-minute prefill)",
                                      min=0.1)
    probe_timeout_s: float = _f(5.0, "seconds a /health probe of llama-server (ocache's own, or a "
                                "client's /health through ocache) may take; longer counts as not "
                                "answering (llama-server answers /health at once, even while busy)",
                                min=0.1)
    hung_probes: int = _f(3, "llama-server is declared hung (the forwards in flight to it ended, "
                          "their tasks cancelled) only after this many /health probes in a row "
                          "got no answer in probe_timeout_s each (one slow probe on a loaded "
                          "machine is not a stopped server)", min=1, max=100)
    view_timeout_s: float = _f(30.0, "the most seconds a request's token view (llama-server's "
                               "/apply-template and /tokenize of its prompt) may take, however long "
                               "its prompt; then the request is forwarded as sent (X-OCache-Fail-Open: "
                               "plan), whoever else the server is serving", min=0.05)
    view_slack_s: float | None = _f(None, "seconds a token view may take beyond the prefill it "
                                    "could save (the prompt's estimated tokens at the measured "
                                    "prefill rate), at most view_timeout_s; then the request is "
                                    "forwarded as sent; unset: 5 (ocache.tokens.VIEW_SLACK_S)",
                                    min=0.0)
    loading_wait_s: float = _f(120.0, "requests that arrive while llama-server loads its model are "
                               "held until it is ready, at most this many seconds; then they get "
                               "the server's 503 with Retry-After", min=0)
    client_idle_timeout_s: float = _f(60.0, "a client that sends no byte of its request body for "
                                      "this many seconds gets 408 (slow or stuck clients)", min=0.1)
    client_keepalive_s: float = _f(75.0, "idle keep-alive client connections are closed after this "
                                   "many seconds", min=0.1)
    launch_max_failures: int = _f(5, "with `launch`: after this many exits in a row within 5 s of "
                                  "a start, ocache stops restarting the child and exits with status 1",
                                  min=1)
    no_cache: bool = _f(False, "forward everything untouched (the NullLayer), e.g. to compare")
    record_dir: str | None = _f(None, "if set, record each completion request (body, plan, "
                                "timings) as JSON lines in this folder, for replay (ocache/record.py)")
    record_redact: bool = _f(False, "with record_dir: drop all text, keep structure and counts")
    launch: list[str] = _f([], "llama-server arguments: ocache starts the (patched) server as a "
                           "child with them and restarts it if it dies (`serve --launch -- ARGS`)")
    launch_replicas: int = _f(1, "with `launch`: how many llama-server children to start (one per "
                              "GPU), each on its own free port with the same arguments; the router "
                              "spreads requests over them", min=1)
    launch_devices: list[str] = _f([], "with `launch`: per child, the value of CUDA_VISIBLE_DEVICES "
                                   "(e.g. [\"0\", \"1\"]; `--device` in the arguments works too); "
                                   "unset: the children inherit the environment")
    launch_binary: str | None = _f(None, "llama-server binary for `launch`; default: the patched "
                                   "engine build (`ocache engine path`)")
    launch_backend: str = _f("cpu", "which `ocache engine build --backend` build `launch` runs when "
                             "launch_binary is unset", choices=("cpu", "cpu-avx2", "cuda", "hip",
                                                               "metal", "vulkan"))
    disk_budget_gb: float = _f(50.0, "disk tier: most GB of anchors kept", min=0)
    disk_ttl_days: float = _f(7.0, "disk tier: anchors unused this many days are evicted", min=0)
    disk_min_tokens: int = _f(4096, "disk tier: shortest prefix (tokens) worth an anchor", min=0)
    spill_budget_gb: float = _f(40.0, "session tier: most GB of spilled conversations", min=0)
    spill_min_tokens: int = _f(256, "session tier: shortest conversation (tokens) worth a spill "
                               "before eviction (a save costs ~1/300 of the prefill it spares)",
                               min=0)
    volatile_markers: list[str] | None = _f(None, "strings that start the volatile part of a system "
                                            "prompt (e.g. '<env>'); unset = the fingerprint "
                                            "module's defaults")
    response_cache: dict = _f({}, "the response cache (ocache/response_cache.py): the stored "
                              "answer of an identical greedy request, replayed without the server; "
                              "keys `enabled` (false), `ttl_s` (600: seconds an answer is served), "
                              "`max_mb` (64: MiB of answers kept)")
    tiers: dict = _f({}, "per-tier settings: tiers.<tier>.<key>, the keys listed below (any other "
                     "key is a config error)")
    store: dict = _f({}, "the store below the tiers: store.remote.{url: s3://bucket/prefix, "
                     "endpoint_url, region, profile, max_gb, budget_gb, ttl_s, policy, sync_s, "
                     "refresh_s, orphan_age_s, fleet_key} shares anchors, heads and spilled sessions "
                     "between hosts through an S3-compatible bucket (ocache/tiers/remote.py; pip "
                     "install 'ocache[s3]'); credentials from the usual AWS environment or files, "
                     "never in the URL; max_gb (100) bounds this host's own uploads; the bucket's "
                     "budget and TTL are its policy object's (policy.json), created by the first host "
                     "from its budget_gb (default max_gb) and ttl_s (seconds after an entry's last "
                     "use, 0: none); policy: replace writes this host's over it once at start "
                     "(default keep); fleet_key (or env OCACHE_FLEET_KEY) signs the bucket's records "
                     "and policy")

    # ----------------------------------------------------------------------------------------------
    @property
    def bind_names(self) -> set[str]:
        """Host names the DNS-rebinding guard accepts (lower case, no port)."""
        names = {"localhost", "127.0.0.1", "::1", "[::1]", self.host.lower()}
        names.update(h.lower() for h in self.allowed_hosts)
        return names

    def to_dict(self, redact: bool = True) -> dict:
        d = dataclasses.asdict(self)
        if redact:
            for k in ("admin_token", "upstream_api_key"):
                if d.get(k):
                    d[k] = "***"
        return d


FIELDS = {f.name: f for f in dataclasses.fields(Config)}


def describe() -> str:
    """The schema as a text table: key, type, default, doc; then every ``tiers.<tier>.<key>``
    (``TIER_DOCS``). ``ocache serve --help-config`` prints it; tests/test_config_keys.py checks that
    every key listed here has an effect."""
    hints = typing.get_type_hints(Config)
    rows = []
    for name, f in FIELDS.items():
        default = (f.default if f.default is not dataclasses.MISSING
                   else f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        rows.append(f"{name:18} {_type_name(hints[name]):14} default={default!r}\n"
                    f"{'':18} {f.metadata['doc']}")
    for tier, keys in TIER_DOCS.items():
        for key, (tp, default, doc) in keys.items():
            rows.append(f"{'tiers.' + tier + '.' + key:32} {tp:10} default={default}\n"
                        f"{'':18} {doc}")
    return "\n".join(rows)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(type without Optional, optional?)"""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _coerce(name: str, value: Any, source: str, from_env: bool = False) -> Any:
    """Convert and check one value for field ``name``; raise ConfigError naming ``source``."""
    tp, optional = _base_type(typing.get_type_hints(Config)[name])
    meta = FIELDS[name].metadata
    where = f"{source}: {name}"
    if value is None or (from_env and value == "" and optional):
        if optional:
            return None
        raise ConfigError(f"{where}: a value is required ({_type_name(tp)})")
    origin = typing.get_origin(tp) or tp
    try:
        if origin is bool:
            if isinstance(value, str):
                low = value.strip().lower()
                if low in ("1", "true", "yes", "on"):
                    value = True
                elif low in ("0", "false", "no", "off"):
                    value = False
                else:
                    raise ConfigError(f"{where}: expected a boolean, got {value!r}")
            elif not isinstance(value, bool):
                raise ConfigError(f"{where}: expected a boolean, got {value!r}")
        elif origin is int:
            if isinstance(value, bool) or isinstance(value, float) and not value.is_integer():
                raise ConfigError(f"{where}: expected an integer, got {value!r}")
            value = int(value)
        elif origin is float:
            if isinstance(value, bool):
                raise ConfigError(f"{where}: expected a number, got {value!r}")
            value = float(value)
        elif origin is str:
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ConfigError(f"{where}: expected a string, got {value!r}")
            value = str(value)
        elif origin is list:
            if isinstance(value, str):
                if from_env and name in ("launch",):
                    value = yaml.safe_load(value) if value.strip().startswith("[") else value.split()
                else:
                    value = [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(value, (list, tuple)) or not all(
                    isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
                raise ConfigError(f"{where}: expected a list of strings, got {value!r}")
            value = [str(v) for v in value]
        elif origin is dict:
            if isinstance(value, str):
                value = yaml.safe_load(value) or {}
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: expected a mapping, got {value!r}")
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{where}: invalid value {value!r} ({exc})") from None
    if "min" in meta and value < meta["min"]:
        raise ConfigError(f"{where}: {value!r} is below the minimum {meta['min']}")
    if "max" in meta and value > meta["max"]:
        raise ConfigError(f"{where}: {value!r} is above the maximum {meta['max']}")
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(meta['choices'])}")
    if name == "upstream":
        _check_url(value, where)
    if name == "upstreams":
        for v in value:
            _check_url(v, where)
    return value


def _check_url(value: str, where: str) -> None:
    from yarl import URL

    try:
        url = URL(value)
    except ValueError as exc:
        raise ConfigError(f"{where}: {value!r} is not a URL ({exc})") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ConfigError(f"{where}: {value!r} must be an http(s)://host:port URL")
    if url.path not in ("", "/") or url.query_string:
        raise ConfigError(f"{where}: {value!r} must be a base URL without a path or query")


def read_yaml(path: str | os.PathLike) -> dict:
    """The YAML file as a mapping (empty file = {}); ConfigError if unreadable or not a mapping."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the config file ({exc.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML ({exc})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of config keys")
    return data


def load(path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None,
         overrides: Mapping[str, Any] | None = None) -> Config:
    """Build the effective Config: defaults < YAML (``path`` / ``$OCACHE_CONFIG`` /
    ``./ocache.yaml``) < env ``OCACHE_*`` < ``overrides`` (CLI flags; None values are skipped).

    Raises ConfigError for unknown YAML or override keys and for bad values.
    """
    env = os.environ if env is None else env
    for name, why in REMOVED.items():
        if "OCACHE_" + name.upper() in env:
            raise ConfigError(f"env OCACHE_{name.upper()}: the key {name!r} was removed: {why}")
    values: dict[str, Any] = {}
    if path is None:
        path = env.get("OCACHE_CONFIG") or None
        if path is None and Path("ocache.yaml").is_file():
            path = "ocache.yaml"
    if path is not None:
        data = read_yaml(path)
        for k in data:
            if k in REMOVED:
                raise ConfigError(f"{path}: the key {k!r} was removed: {REMOVED[k]}")
        unknown = sorted(set(map(str, data)) - set(FIELDS))
        if unknown:
            raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)}; known keys: "
                              f"{', '.join(FIELDS)}")
        for k, v in data.items():
            values[k] = _coerce(k, v, str(path))
    for name in FIELDS:
        key = "OCACHE_" + name.upper()
        if key in env:
            values[name] = _coerce(name, env[key], f"env {key}", from_env=True)
    _warn_env_typos(env)
    for k, v in (overrides or {}).items():
        if k in REMOVED and v is not None:
            raise ConfigError(f"the key {k!r} was removed: {REMOVED[k]}")
        if k not in FIELDS:
            raise ConfigError(f"unknown config key {k!r}")
        if v is None:
            continue
        values[k] = _coerce(k, v, "command line")
    cfg = Config(**values)
    check_tiers(cfg.tiers)
    check_response_cache(cfg.response_cache)
    check_store(cfg.store)
    return cfg


def _warn_env_typos(env: Mapping[str, str]) -> list[str]:
    """Warn of each ``OCACHE_*`` variable that is no config key but nearly spells one
    (``OCACHE_ADMIN_TOKN``): other variables with the prefix are not config keys and stay ignored
    (module docstring), a near miss is most likely a typo that would silently leave the key unset.
    Returns the warnings."""
    import difflib

    keys = {"OCACHE_" + n.upper() for n in FIELDS}
    said = []
    for var in sorted(v for v in env if v.startswith("OCACHE_") and v not in keys):
        near = difflib.get_close_matches(var, keys, n=1, cutoff=0.9)
        if near:
            said.append(f"env {var} is not a config key (ignored): did you mean {near[0]}?")
            logging.getLogger("ocache.config").warning("%s", said[-1])
    return said


#: Keys that were accepted once and are gone; naming one is a ConfigError with this advice.
REMOVED = {
    "n_parallel": "it was never read; the slot count comes from GET /slots, and the planner reads -np "
                  "from `launch` or tiers.resident.server_args",
}

#: Keys each tier reads from ``tiers.<name>``: (type, default, what it does), printed by
#: ``describe()``. Readers: ``layer_options`` (ocache/cache/wiring.py), ``make_disk_tier``
#: (ocache/tiers/disk.py), ``make_session_tier`` (ocache/tiers/spill.py).
TIER_DOCS: dict[str, dict[str, tuple[str, str, str]]] = {
    "resident": {
        "server_args": ("list[str]", "the `launch` argv",
                        "llama-server's argv when ocache did not launch it (the planner reads -np, "
                        "-ub, the checkpoint flags and --slot-save-path from it); `ocache serve "
                        "--upstream URL -- ARGS` sets it; unset, a patched server's /props report is read"),
        "warm": ("bool", "true", "prefill the harness head on its own and keep it (head warm-up)"),
        "keep_origin": ("bool", "true", "keep the head origin in a side slot: after a guest "
                        "overwrote it, restore it there from the head's slot file"),
        "reconcile": ("bool", "true", "GET /slots before each plan to correct the slot table"),
        "known": ("bool", "true", "forward the next turn of a conversation a slot holds (its "
                  "earlier messages unchanged, the template checked append-only) to that slot before its token "
                  "view is built; the view and the figures follow while the server works (the known route: "
                  "X-OCache-Path: known; `fast_path`, its former name, is still read, with a warning)"),
        "align": ("true | false | exact", "true", "serve a request that repeats the conversation a slot holds, except "
                  "for what the chat template or the client rewrote (past reasoning dropped or "
                  "re-rendered), as the slot's own tokens plus the request's new part (patch 0008; "
                  "the model sees its earlier reasoning); false: every prompt is the template's, "
                  "byte for byte; exact: every prompt the template's, and after a turn that ended "
                  "without a tool call the next prompt's prefix is prefilled while the server is idle"),
        "continue_compaction": ("bool", "true", "serve a client's compaction request (opencode's: the "
                                "history flattened as text) of a conversation a slot holds as that "
                                "conversation's tokens plus one user turn with the client's instruction "
                                "(patch 0008; needs align); false: forwarded as sent"),
        "<ServerParams.field>": ("any", "from the argv",
                                 "override one field of ocache.llama.flags.ServerParams (e.g. n_ubatch, "
                                 "checkpoints, checkpoint_min_step)"),
    },
    "disk": {
        "enabled": ("bool", "true", "false: no disk tier (no anchors written or restored)"),
        "slot_save_path": ("str", "--slot-save-path of the argv",
                           "the server's --slot-save-path, where anchor slot files are written"),
        "grid": ("int", "1024", "tokens between the repeated-prefix grid lines that may get anchors"),
        "free_floor_gb": ("float", "0", "GB the slot-save file system keeps free; no anchor is "
                          "written below it"),
        "admit_after": ("int", "2", "sightings of a grid line before it gets an anchor"),
    },
    "head": {
        "budget_gb": ("float", "10", "most GB of saved harness heads (oc-h-* files); 0: no head "
                      "files, heads kept warm by prefill only"),
    },
    "session": {
        "enabled": ("bool", "true", "false: no session tier (no spills, no restores)"),
        "slot_save_path": ("str", "--slot-save-path of the argv", "as tiers.disk.slot_save_path"),
        "drain_min_tokens": ("int", "1024", "on a planned stop, shortest conversation (tokens) spilled"),
        "guest_min_tokens": ("int", "256", "shortest guest (a title request; tokens) spilled when a "
                             "request overwrites its slot: the next title restores its prompt, as "
                             "llama-server alone restores it from its RAM cache"),
        "resume": ("bool", "true", "after a drain, restore the last conversation at the next start"),
        "live_save": ("str", "remote", "save a live conversation's slot at idle after each completed "
                      "turn (at most once a turn, only when it changed, never while a request is in "
                      "flight), so the bucket holds every conversation's last turn and a crashed host "
                      "loses at most the turn in flight: remote = when store.remote is set, true = "
                      "always (a local crash too), false = never (ocache/tiers/live.py)"),
        "live_save_quiet_s": ("float", "1", "seconds with no request after a turn before its live save "
                              "(an agent's next request comes within milliseconds)"),
    },
}

#: Keys each tier reads from ``tiers.<name>``; the resident tier also takes any
#: ``ocache.llama.flags.ServerParams`` field as an override.
TIER_KEYS = {name: {k for k in keys if not k.startswith("<")} for name, keys in TIER_DOCS.items()}
#: keys of ``tiers.<name>`` that were renamed: the former name is still read, with a warning
#: (``check_tiers``); a config that gives both reads the new one
RENAMED_TIER_KEYS: dict[str, dict[str, str]] = {"resident": {"fast_path": "known"}}


def tier_key(sub: Mapping[str, Any], tier: str, key: str, default: Any) -> Any:
    """``tiers.<tier>.<key>`` of ``sub`` (that tier's mapping), else its former name's value
    (``RENAMED_TIER_KEYS``), else ``default``."""
    if key in sub:
        return sub[key]
    for old, new in RENAMED_TIER_KEYS.get(tier, {}).items():
        if new == key and old in sub:
            return sub[old]
    return default


def align_mode(value: Any) -> str:
    """``tiers.resident.align``'s value as a mode: ``"splice"`` (true, the default), ``"off"``
    (false) or ``"exact"`` (``ocache.cache.align_route.mode`` reads it). Raises ConfigError for
    another value."""
    if value is True or value == "splice":
        return "splice"
    if value is False or value == "off":
        return "off"
    if value == "exact":
        return "exact"
    raise ConfigError(f"tiers.resident.align: {value!r} is not one of true, false, exact")


def check_tiers(tiers: Mapping[str, Any]) -> None:
    """Reject unknown tier names and keys under ``tiers:`` (a typo there would silently drop the
    server flags ocache needs). Raises ConfigError."""
    from ocache.llama.flags import ServerParams

    for name, sub in (tiers or {}).items():
        if name not in TIER_KEYS:
            raise ConfigError(f"tiers: unknown tier {name!r}; known: {', '.join(TIER_KEYS)}")
        if not isinstance(sub, Mapping):
            raise ConfigError(f"tiers.{name}: expected a mapping, got {sub!r}")
        renamed = RENAMED_TIER_KEYS.get(name, {})
        for old in sorted(set(map(str, sub)) & set(renamed)):
            logging.getLogger("ocache.config").warning(
                "tiers.%s.%s is deprecated: it is now tiers.%s.%s (the old name is still read)",
                name, old, name, renamed[old])
        allowed = (TIER_KEYS[name] | set(renamed)
                   | (set(ServerParams.__dataclass_fields__) if name == "resident" else set()))
        unknown = sorted(set(map(str, sub)) - allowed)
        if unknown:
            also = " and llama-server's parameters (`ocache serve --help-config`)" if name == "resident" else ""
            raise ConfigError(f"tiers.{name}: unknown key(s) {', '.join(unknown)}; known: "
                              f"{', '.join(sorted(TIER_KEYS[name]))}{also}")
        if name == "resident" and "align" in sub:
            align_mode(sub["align"])
        if name == "session" and "live_save" in sub:
            from ocache.tiers.live import live_mode

            try:
                live_mode(sub["live_save"])
            except ValueError as exc:
                raise ConfigError(str(exc)) from None


#: the keys of ``response_cache:`` and their types (ocache/response_cache.py reads them)
RESPONSE_CACHE_KEYS: dict[str, tuple[type, ...]] = {"enabled": (bool,), "ttl_s": (int, float),
                                                    "max_mb": (int, float)}


def check_response_cache(rc: Mapping[str, Any]) -> None:
    """Reject an unknown key or a bad value under ``response_cache:`` (ConfigError)."""
    given: dict[str, Any] = dict(rc or {})
    for k, v in given.items():
        if k not in RESPONSE_CACHE_KEYS:
            raise ConfigError(f"response_cache: unknown key {k!r}; known: "
                              f"{', '.join(RESPONSE_CACHE_KEYS)}")
        if isinstance(v, bool) != (k == "enabled") or not isinstance(v, RESPONSE_CACHE_KEYS[k]):
            raise ConfigError(f"response_cache.{k}: invalid value {v!r}")
        if k != "enabled" and given[k] <= 0:
            raise ConfigError(f"response_cache.{k}: {v!r} must be above 0")


#: Keys of ``store.remote`` (``ocache.tiers.remote.RemoteSettings``): name -> type.
STORE_REMOTE_KEYS = {"url": str, "endpoint_url": str, "region": str, "profile": str, "max_gb": float,
                     "budget_gb": float, "ttl_s": float, "policy": str, "sync_s": float, "refresh_s": float, "orphan_age_s": float, "fleet_key": str,
                     "index_max_entries": float, "index_max_mb": float}
#: keys of ``store.remote`` whose values are secrets: no message shows them
STORE_REMOTE_SECRETS = {"fleet_key"}


def check_store(store: Mapping[str, Any]) -> None:
    """Reject unknown keys under ``store:`` and ``store.remote``, a remote without an
    ``s3://bucket`` url and mistyped values. Raises ConfigError."""
    unknown = sorted(set(map(str, store or {})) - {"remote"})
    if unknown:
        raise ConfigError(f"store: unknown key(s) {', '.join(unknown)}; known: remote")
    remote = (store or {}).get("remote")
    if remote is None:
        return
    from ocache.tiers.remote_client import Location, RemoteConfigError, refuse_credentials

    if not isinstance(remote, Mapping):   # (its value is not shown: it may be a URL with a secret)
        raise ConfigError(f"store.remote: expected a mapping, got a {type(remote).__name__}")
    bad = sorted(set(map(str, remote)) - set(STORE_REMOTE_KEYS))
    if bad:
        raise ConfigError(f"store.remote: unknown key(s) {', '.join(bad)}; known: {', '.join(STORE_REMOTE_KEYS)}")
    for k, tp in STORE_REMOTE_KEYS.items():
        v = remote.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (str,) if tp is str else (int, float))):
            shown = f"a {type(v).__name__}" if k in STORE_REMOTE_SECRETS or tp is str else repr(v)
            raise ConfigError(f"store.remote.{k}: expected a {tp.__name__}, got {shown}")
        if isinstance(v, (int, float)) and tp is float and (v < 0 or (v == 0 and k in ("max_gb", "budget_gb"))):
            raise ConfigError(f"store.remote.{k}: {v!r} must be above 0" if k in ("max_gb", "budget_gb")
                              else f"store.remote.{k}: {v!r} must be 0 or more")
    if remote.get("policy") not in (None, "keep", "replace"):
        raise ConfigError(f"store.remote.policy: {remote['policy']!r} is not keep or replace")
    try:   # credentials in a URL are refused, the message never shows them
        Location.parse(str(remote.get("url") or ""))
        if remote.get("endpoint_url"):
            refuse_credentials(str(remote["endpoint_url"]), "endpoint_url")
    except RemoteConfigError as exc:
        raise ConfigError(str(exc)) from None


def field_of(obj: Any, name: str, default: Any = None) -> Any:
    """``obj[name]`` for a dict, ``obj.name`` otherwise; ``default`` when absent or ``obj`` is None
    (tiers and the recorder accept a ``Config`` or a plain dict)."""
    if obj is None:
        return default
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def slot_save_path(config: Any, params: Any = None) -> Path | None:
    """Where the server writes slot files (its ``--slot-save-path``), by the first source that
    says: ``tiers.session.slot_save_path``, ``tiers.disk.slot_save_path``, the ``config.launch``
    argv, ``tiers.resident.server_args``, else ``params.slot_save_path`` (the parsed
    ``ServerParams``); ``~`` is expanded (a YAML list is not a shell: ``~/slots`` there means the
    home directory, as it does on the command line that started the server).

    None when nothing says (the server cannot save slots, docs/llama-server.md §3) or when the
    directory does not exist here: ocache reads and renames the files the server writes, so both
    must see the same directory (a path ocache cannot find would make every save leak a file in the
    server's directory; it is logged once as an error and the tiers that need it stay off). Raises
    ValueError on a malformed argv (``ocache.llama.flags.given_flags``)."""
    from ocache.llama.flags import given_flags

    tiers = field_of(config, "tiers") or {}
    tiers = tiers if isinstance(tiers, dict) else {}
    found: str | None = None
    for name in ("session", "disk"):
        t = tiers.get(name)
        if isinstance(t, dict) and t.get("slot_save_path"):
            found = str(t["slot_save_path"])
            break
    if found is None:
        res = tiers.get("resident")
        for argv in (field_of(config, "launch"), res.get("server_args") if isinstance(res, dict) else None):
            if argv:
                found = given_flags([str(a) for a in argv]).get("slot_save_path")
                if found:
                    break
    if not found:
        found = field_of(params, "slot_save_path")
    if not found:
        return None
    path = Path(found).expanduser()
    if not path.is_dir():
        if str(path) not in _missing_logged:
            _missing_logged.add(str(path))
            logging.getLogger("ocache.config").error(
                "--slot-save-path %s is not a directory here: ocache must see the directory "
                "llama-server writes its slot files to (an absolute path, the same for both); the "
                "disk, session and head tiers stay off", found)
        return None
    return path


_missing_logged: set[str] = set()
