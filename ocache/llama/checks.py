"""The llama-server settings each cache tier needs, checked, with the reason (``ocache doctor``,
and the cache layer when it starts).

The stock llama-server does not report its launch flags (``docs/llama-server.md`` §16; the patched
one does, ``/props`` ``ocache.launch``, patches/0009), so the checks read them from the launch argv
(``ocache serve --launch`` / the config's ``launch``, ``tiers.resident.server_args`` or ``ocache
serve|doctor --upstream URL -- ARGS``), else from ``/props`` ``ocache.launch``, and from what the server does report (``/props``, ``/slots``, whether
``/metrics`` answers, whether ``POST /slots/0?action=...`` is enabled). The same ``check`` runs
when the cache layer starts (its findings are logged as warnings and shown in the stats).

Output: one line per flag of ``FLAGS`` (``ok`` / ``info`` / ``warning`` / ``error``, or ``unknown``
when neither the command line nor the server tells: a default the server does not report is never
warned about as if it were known). ``--offline`` checks a command line alone (no server; the model's
architecture is read from the ``-m`` GGUF). A URL that answers but not as llama-server does (no
``/health`` ``{"status": "ok"}``, no llama-server ``/props``) gets "not llama-server" and exit 2.

What ocache needs and why (README "Flags ocache wants on llama-server", turned into checks):

* ``-np N`` explicit: unset means 4 slots on a *unified* KV, where ``--cache-idle-slots`` (default
  on) clears every idle slot as soon as another request starts (docs/llama-server.md §9): nothing stays
  resident. ``N >= 2`` lets guests (title requests) use a side slot instead of the conversation.
* ``--slot-save-path DIR``: save/restore are off without it (501, docs/llama-server.md §3), so the disk and
  session tiers and the saved harness head cannot work.
* hybrid/recurrent models: ``--ctx-checkpoints > 0`` (with 0, any prompt that does not strictly
  extend a slot re-prefills from token 0, docs/llama-server.md §15) and a ``--checkpoint-min-step`` of
  at most ``CHECKPOINT_MIN_STEP`` (1024, the README's value; the reason is at the constant), or
  at most the harness head when ``--head-tokens`` gives it.
* ``--metrics``: the ``/metrics`` ``Process-Start-Time-Unix`` header is the restart signal.
* the patched build (``build_info`` contains ``+ocache.``): a stock server restores a hybrid slot
  without its checkpoints (docs/llama-server.md §6), so only prompts that strictly extend it reuse anything.
* ``--cache-ram 0`` (docs/decisions.md D1, as the README's flag list says): with the RAM cache on, a
  request pinned to a busy slot makes the server save it and swap a RAM entry in (docs/llama-server.md
  §9 step 4, "Hazard") and ``cache_n`` becomes unpredictable; the session tier does the parking.
  Any other value, the default 8192 MiB included, is a warning (it turns no tier off).
* ``-fa auto``: slot files depend on the resolved flash-attention setting (docs/llama-server.md §6); pin it.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ocache.llama.flags import ServerParams, argv_from_launch, params_from_argv

OK, INFO, WARN, ERROR, UNKNOWN = "ok", "info", "warning", "error", "unknown"

#: The one fix for launch flags ocache cannot see (a server it did not launch that does not report
#: them: the stock build; the patched one does, patches/0009), said alike by every ``unknown``
#: finding, the ``--slot-save-path`` tier-off line and the disk and session tiers' "off" log lines:
#: ``ocache serve --upstream URL -- ARGS`` takes ARGS as ``tiers.resident.server_args``
#: (ocache/commands/serve.py), and ``ocache doctor --upstream URL -- ARGS`` checks them.
FLAGS_FIX = ("pass llama-server's command line after `--` (`ocache serve --upstream URL -- ARGS`; "
             "in ocache.yaml: tiers.resident.server_args)")

#: The ``--checkpoint-min-step`` ocache recommends (the README's command lines, the bench's (b) and
#: (c), ``ocache.bench.run.Preset``): checkpoints at user messages are at least this many tokens
#: apart (docs/llama-server.md §14), so a hybrid resume after a rewritten or diverging history can
#: land up to this many tokens before the divergence and prefill them again. The stock 8192 is
#: coarser than a whole 7-9k-token harness head; 1024 (two default ubatches) keeps that re-prefill
#: small while 32 checkpoints (``--ctx-checkpoints 32``) still cover a 32k-token conversation.
#: Above it ``check`` warns; no tier is off either way.
CHECKPOINT_MIN_STEP = 1024

#: Every flag ``check`` reports on, in print order: each gets exactly one line.
FLAGS = ("-np", "-kvu", "--slot-save-path", "--ctx-checkpoints", "--checkpoint-min-step", "-ub",
         "--metrics", "--cache-ram", "-fa", "build", "model")


class NotLlamaServer(RuntimeError):
    """The URL answers HTTP but is not llama-server (the message says what it answered)."""


#: The tiers a finding can turn off (``Finding.off``): ``resident`` (slots keep conversations),
#: ``head`` (harness-head files), ``disk`` (prefix anchors), ``session`` (spilled conversations).
TIERS = ("resident", "head", "disk", "session")
_SAVE_TIERS = ("disk", "session", "head")


@dataclass(frozen=True)
class Finding:
    """One check result: ``level`` (ok/info/warning/error/unknown), ``flag`` it is about,
    ``message`` (why); ``off``: the tiers of ``TIERS`` it turns off (empty: none), ``fix``: the
    one-line fix (empty when nothing is to be done)."""

    level: str
    flag: str
    message: str
    off: tuple[str, ...] = ()
    fix: str = ""

    def __str__(self) -> str:
        return f"[{self.level}] {self.flag}: {self.message}"


@dataclass(frozen=True)
class TierOff:
    """A tier that cannot work with this server: ``tier`` (one of ``TIERS``), ``why`` (the
    finding's message, with its flag) and ``fix`` (one line)."""

    tier: str
    why: str
    fix: str

    def __str__(self) -> str:
        return f"{self.tier} tier off: {self.why}. Fix: {self.fix}"


def tiers_off(findings: Sequence[Finding]) -> list[TierOff]:
    """The tiers ``findings`` turn off, in ``TIERS`` order, each once (the first finding that
    turns it off gives the reason). Pure."""
    out: dict[str, TierOff] = {}
    for f in findings:
        for tier in f.off:
            out.setdefault(tier, TierOff(tier, f"{f.flag}: {f.message}", f.fix))
    return [out[t] for t in TIERS if t in out]


def tiers_off_lines(off: Sequence[TierOff | Mapping[str, str]]) -> list[str]:
    """``tiers_off``'s answer (``TierOff`` or its ``__dict__``, as ``/v1/cache/stats`` carries it)
    as the lines ``ocache serve``'s log, ``ocache stats`` and ``ocache doctor`` print first: one
    per reason, naming the tiers it turns off, with the fix; one line saying every tier can work
    when none is off."""
    items = [t if isinstance(t, TierOff) else TierOff(str(t.get("tier")), str(t.get("why")), str(t.get("fix")))
             for t in off]
    if not items:
        return ["tiers: all on (resident, head, disk, session): nothing in the server's setup turns one off"]
    groups: dict[tuple[str, str], list[str]] = {}
    for t in items:
        groups.setdefault((t.why, t.fix), []).append(t.tier)
    out = []
    for (why, fix), names in groups.items():
        tiers = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        out.append(f"tiers OFF: {tiers} ({why}). Fix: {fix}")
    return out


def verdict(findings: Sequence[Finding], remote_ok: bool | None = None) -> tuple[int, str]:
    """``ocache doctor``'s exit status and last line (pure): 1 when a tier is off
    (``tiers_off``), a flag is an ``error`` or the remote store check failed (``remote_ok`` False),
    the line then naming the tiers off and the flags in error; else 0 and a line saying every tier
    can work (with the number of warnings, which turn no tier off)."""
    off = [t.tier for t in tiers_off(findings)]
    errors = list(dict.fromkeys(f.flag for f in findings if f.level == ERROR))
    if off or errors or remote_ok is False:
        why = []
        if off:
            why.append("tiers off: " + ", ".join(off))
        if errors:
            why.append("errors: " + ", ".join(errors))
        if remote_ok is False:
            why.append("store.remote failed")
        return 1, "doctor: FAIL (" + "; ".join(why) + "): exit 1"
    warnings = sum(1 for f in findings if f.level == WARN)
    return 0, ("doctor: OK: every tier can work, no error"
               + (f" ({warnings} warning{'s' if warnings != 1 else ''}, none turns a tier off)" if warnings else ""))


@dataclass(frozen=True)
class _Seen:
    """What one ``check`` knows: ``params``, the server's ``props`` ({} offline), ``known``: the
    launch argv is known; ``server``: a server was queried; ``n_slots``: from ``/slots`` when it
    answered, else the params'; the probes ``metrics_ok``/``slot_actions_ok``; ``head_tokens``."""

    params: ServerParams
    props: Mapping
    known: bool
    server: bool
    n_slots: int
    metrics_ok: bool | None
    slot_actions_ok: bool | None
    head_tokens: int | None
    slots_seen: bool


def check(params: ServerParams, props: Mapping | None, slots: Sequence[Mapping] | None = None, *,
          argv: Sequence[str] | None = None, metrics_ok: bool | None = None,
          slot_actions_ok: bool | None = None, head_tokens: int | None = None) -> list[Finding]:
    """The findings (pure): one per flag of ``FLAGS``, in that order, plus ``--slots`` when the
    server has its slots endpoint off. ``argv`` None = launch flags unknown (an external server):
    what the server does not report is then ``unknown`` (never a warning about a default it cannot
    know); ``props`` None = no server queried (offline: the command line alone). ``metrics_ok``:
    ``/metrics`` answered 200; ``slot_actions_ok``: ``POST /slots`` is enabled (both None = not
    probed). ``head_tokens``: a harness head length to compare ``--checkpoint-min-step`` with.
    Reads the file system once: whether ``--slot-save-path`` is a directory here.
    """
    seen = _Seen(params, props or {}, known=argv is not None, server=props is not None,
                 n_slots=len(slots) if slots else params.n_slots, metrics_ok=metrics_ok,
                 slot_actions_ok=slot_actions_ok, head_tokens=head_tokens, slots_seen=bool(slots))
    out: list[Finding] = []
    if slots is not None and seen.props.get("endpoint_slots") is False:
        out.append(Finding(ERROR, "--slots", "the /slots endpoint is off: ocache cannot reconcile slots"))
    for rule in (_check_np, _check_kvu, _check_slot_save_path, _check_checkpoints, _check_metrics,
                 _check_cache_ram, _check_fa, _check_build, _check_model):
        out.extend(rule(seen))
    return out


def _check_np(c: _Seen) -> list[Finding]:
    if c.known and not c.params.n_parallel_explicit:
        return [Finding(ERROR, "-np", "not set: the server runs 4 slots on a unified KV and clears idle "
                        "slots when another request starts (--cache-idle-slots); nothing stays resident. "
                        "Set -np N (2 or more)", off=("resident",),
                        fix="restart llama-server with -np 2")]
    if (c.known or c.slots_seen) and c.n_slots < 2:
        return [Finding(WARN, "-np", "1 slot: a guest request (title, tags) replaces the conversation; use "
                        "-np 2 so guests get a side slot, or rely on the session tier to spill and restore it")]
    if c.known or c.slots_seen:
        return [Finding(OK, "-np", f"{c.n_slots} slots" + ("" if c.known else " (from /slots)"))]
    return [Finding(UNKNOWN, "-np", "not on the command line and no server to ask")]


def _check_kvu(c: _Seen) -> list[Finding]:
    """``-kvu`` with ``--cache-idle-slots``."""
    if not c.known:
        return [Finding(UNKNOWN, "-kvu", f"the server does not report it: {FLAGS_FIX}")]
    if c.params.kv_unified and c.params.cache_idle_slots:
        return [Finding(ERROR, "-kvu", "a unified KV with --cache-idle-slots clears every idle slot when a "
                        "request starts; use --no-cache-idle-slots or drop -kvu", off=("resident",),
                        fix="restart llama-server with --no-cache-idle-slots, or without -kvu")]
    return [Finding(OK, "-kvu", "per-slot KV" if not c.params.kv_unified else "unified KV with "
                    "--no-cache-idle-slots")]


def _check_slot_save_path(c: _Seen) -> list[Finding]:
    """``--slot-save-path``: set, a directory here, and known to ocache (a stock server that saves
    slots does not say where: ocache cannot find the files, so the tiers that need them are off)."""
    p = c.params
    save_ok = c.slot_actions_ok if c.slot_actions_ok is not None else (bool(p.slot_save_path) if c.known else None)
    if save_ok is False:
        return [Finding(WARN, "--slot-save-path", "not set: slot save/restore is off, so the disk and "
                        "session tiers and the saved harness head are disabled", off=_SAVE_TIERS,
                        fix="mkdir -p DIR and restart llama-server with --slot-save-path DIR (an absolute "
                        "folder this machine sees)")]
    if save_ok and p.slot_save_path and not os.path.isdir(os.path.expanduser(p.slot_save_path)):
        return [Finding(ERROR, "--slot-save-path", f"{p.slot_save_path} is not a directory on this machine: "
                        "ocache must see the directory llama-server writes slot files to (use an absolute "
                        "path, the same for both); the disk, session and head tiers stay off",
                        off=_SAVE_TIERS, fix=f"mkdir -p {p.slot_save_path} where ocache runs (an absolute "
                        "path both processes see) and restart llama-server")]
    if save_ok and not p.slot_save_path:
        return [Finding(WARN, "--slot-save-path", "the server saves slots but does not say where (its "
                        "launch flags are unknown: a stock build does not report them), so ocache cannot "
                        "find the files: the disk, session and head tiers are off", off=_SAVE_TIERS,
                        fix=f"run the patched llama-server (`ocache engine build`; it reports its flags), "
                        f"or {FLAGS_FIX}")]
    if save_ok:
        return [Finding(OK, "--slot-save-path", "slot save/restore enabled")]
    return [Finding(UNKNOWN, "--slot-save-path", "not on the command line and no server to ask")]


def _check_checkpoints(c: _Seen) -> list[Finding]:
    """``--ctx-checkpoints``, ``--checkpoint-min-step`` and ``-ub`` (hybrid/recurrent models only)."""
    p = c.params
    if p.checkpoints is False:
        return [Finding(OK, "--ctx-checkpoints", f"not used by a {p.arch or 'non-recurrent'} model"),
                Finding(OK, "--checkpoint-min-step", f"not used by a {p.arch or 'non-recurrent'} model"),
                Finding(OK, "-ub", f"{p.n_ubatch}" + ("" if "n_ubatch" in p.known else " (default)"))]
    if p.checkpoints is None:
        return [Finding(UNKNOWN, flag, "model architecture unknown (model file not readable here): matters "
                        "for hybrid/recurrent models only")
                for flag in ("--ctx-checkpoints", "--checkpoint-min-step", "-ub")]
    return [_check_ctx_checkpoints(c), _check_min_step(c), _check_ubatch(c)]


def _check_ctx_checkpoints(c: _Seen) -> Finding:
    p = c.params
    if p.ctx_checkpoints <= 0:
        return Finding(ERROR, "--ctx-checkpoints", f"0 on a {p.arch or 'hybrid'} model: a prompt that "
                       "does not strictly extend a slot re-prefills from token 0", off=("resident",),
                       fix="restart llama-server with --ctx-checkpoints 32")
    if c.known or "ctx_checkpoints" in p.known:
        return Finding(OK, "--ctx-checkpoints", f"{p.ctx_checkpoints} per slot"
                       + ("" if "ctx_checkpoints" in p.known else " (default)"))
    return Finding(UNKNOWN, "--ctx-checkpoints", f"the server does not report it (default 32): {FLAGS_FIX}")


def _check_min_step(c: _Seen) -> Finding:
    p, step = c.params, c.params.checkpoint_min_step
    limit = c.head_tokens if c.head_tokens else CHECKPOINT_MIN_STEP
    if not c.known and "checkpoint_min_step" not in p.known:
        return Finding(UNKNOWN, "--checkpoint-min-step", f"the server does not report it (default 8192; "
                       f"ocache wants <= {limit}): {FLAGS_FIX}")
    if step > limit:
        why = ("the harness head" if c.head_tokens else
               "the README's value: a resume then prefills at most that many tokens again")
        return Finding(WARN, "--checkpoint-min-step", f"{step} tokens{'' if 'checkpoint_min_step' in p.known else ' (default)'}: "
                       f"checkpoints at user messages are at least this far apart, so a hybrid resume can "
                       f"land up to {step} tokens early; use <= {limit} ({why})")
    return Finding(OK, "--checkpoint-min-step", f"{step} tokens")


def _check_ubatch(c: _Seen) -> Finding:
    p = c.params
    if not c.known and "n_ubatch" not in p.known:
        return Finding(UNKNOWN, "-ub", f"the server does not report it (default 512): {FLAGS_FIX}")
    if p.n_ubatch > 512:
        return Finding(INFO, "-ub", f"{p.n_ubatch}: a hybrid resume lands on ubatch boundaries; a "
                       "smaller -ub re-reads fewer tokens")
    return Finding(OK, "-ub", f"{p.n_ubatch}")


def _check_metrics(c: _Seen) -> list[Finding]:
    metrics = c.metrics_ok if c.metrics_ok is not None else (c.params.metrics if c.known else None)
    if metrics is False:
        return [Finding(WARN, "--metrics", "off: restarts are detected only from /props and /slots task ids "
                        "(the /metrics Process-Start-Time-Unix header is the signal)")]
    if metrics:
        return [Finding(OK, "--metrics", "on (restart detection by boot id)")]
    return [Finding(UNKNOWN, "--metrics", "not on the command line and no server to ask")]


def _check_cache_ram(c: _Seen) -> list[Finding]:
    p = c.params
    if not (c.known or "cache_ram" in p.known):
        return [Finding(UNKNOWN, "--cache-ram", f"the server does not report it (default 8192 MiB): {FLAGS_FIX}")]
    if p.cache_ram:
        default = "" if "cache_ram" in p.known else " (the default)"
        return [Finding(WARN, "--cache-ram", f"{p.cache_ram} MiB{default}: ocache wants --cache-ram 0 "
                        "(docs/decisions.md D1): with the RAM prompt cache on, a request pinned to a busy "
                        "slot makes the server swap a RAM entry into it, and cache_n can exceed the "
                        "prediction; the session tier parks conversations on disk instead")]
    return [Finding(OK, "--cache-ram", "off")]


def _check_fa(c: _Seen) -> list[Finding]:
    if not c.known:
        return [Finding(UNKNOWN, "-fa", f"the server does not report it: {FLAGS_FIX}")]
    if c.params.flash_attn in (None, "auto"):
        return [Finding(WARN, "-fa", "auto: slot files depend on the resolved flash-attention setting; pin "
                        "-fa on or -fa off")]
    return [Finding(OK, "-fa", str(c.params.flash_attn))]


def _check_build(c: _Seen) -> list[Finding]:
    """The patched build (``build_info`` contains ``+ocache.``)."""
    build = str(c.props.get("build_info", ""))
    if not c.server:
        return [Finding(UNKNOWN, "build", "no server queried (offline)")]
    if "+ocache." in build:
        return [Finding(OK, "build", build)]
    return [Finding(WARN, "build", f"{build or 'unknown build'} is not the patched build: restored hybrid "
                    "slots have no checkpoints (only prompts that strictly extend them reuse anything); run "
                    "`ocache engine build`")]


def _check_model(c: _Seen) -> list[Finding]:
    p = c.params
    if p.checkpoints is None:
        return [Finding(UNKNOWN, "model", "architecture unknown (model file not readable here): set "
                        "tiers.resident.checkpoints in the config for a hybrid model")]
    return [Finding(OK, "model", f"{p.arch or '?'}: "
                    f"{'hybrid/recurrent, resumes at checkpoints' if p.checkpoints else 'resumes at any token'}")]


async def probe_endpoints(session: Any, base_url: str, headers: Mapping[str, str] | None = None) -> tuple[bool | None, bool | None]:
    """``(metrics_ok, slot_actions_ok)`` of a running server: ``GET /metrics`` answers 200 only with
    ``--metrics``; ``POST /slots/0?action=ocache-probe`` answers 501 without ``--slot-save-path``
    and 400 "Invalid action" with it, touching nothing (server-context.cpp:4752-4783). None =
    could not tell (unreachable)."""
    import aiohttp

    base = base_url.rstrip("/")
    out: list[bool | None] = []
    for method, path, good in (("GET", "/metrics", lambda st: st == 200),
                               ("POST", "/slots/0?action=ocache-probe", lambda st: st != 501)):
        try:
            async with session.request(method, base + path, headers=dict(headers or {}),
                                       timeout=aiohttp.ClientTimeout(total=10)) as r:
                await r.read()
                out.append(good(r.status))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            out.append(None)
    return out[0], out[1]


async def probe(base_url: str, argv: Sequence[str] | None, api_key: str | None = None,
                head_tokens: int | None = None) -> tuple[list[Finding], dict]:
    """Query a running server (``/health``, ``/props``, ``/slots``, ``/metrics``, a harmless
    ``POST /slots/0?action=ocache-probe``: 501 without ``--slot-save-path``, 400 "Invalid action"
    with it, server-context.cpp:4752-4783) and run ``check``. ``argv`` None: the launch flags a
    patched server reports (``/props`` ``ocache.launch``, patches/0009), else unknown; the info's
    ``flags`` says which. Raises ``NotLlamaServer`` when the
    URL answers but not as llama-server does (``/health`` 200 ``{"status": "ok"}`` or 503 "Loading
    model", tools/server/server-http.cpp:307-327; ``/props`` with ``build_info``), RuntimeError
    when its ``/props`` refuses the key (401/403: ``--api-key``), aiohttp errors when it cannot be
    reached."""
    import aiohttp

    from ocache.llama.slot_api import is_llama_props, is_loading, json_or_none

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = base_url.rstrip("/")
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as s:
        async with s.get(base + "/health") as r:
            health, body = r.status, json_or_none(await r.read())
            ctype = r.headers.get("Content-Type", "")
        if health == 503 and is_loading(body):
            raise RuntimeError("llama-server is still loading its model (/health 503): try again "
                               "in a moment")
        if health != 200 or not (isinstance(body, dict) and body.get("status") == "ok"):
            raise NotLlamaServer(f"GET /health answered {health} {ctype or ''}".strip()
                                 + ", not llama-server's {\"status\": \"ok\"}")
        async with s.get(base + "/props") as r:
            props_status, props = r.status, json_or_none(await r.read())
        if props_status in (401, 403):   # /health is open under --api-key, /props is not
            raise RuntimeError(f"GET /props answered {props_status}: llama-server runs with --api-key "
                               "and refuses this key or none; pass --api-key KEY (ocache serve reads "
                               "upstream_api_key)")
        if props_status == 404 or (props_status == 200 and not is_llama_props(props)):
            raise NotLlamaServer(f"GET /props answered {props_status} without llama-server's "
                                 "build_info / total_slots")
        props = props if props_status == 200 and isinstance(props, dict) else {}
        async with s.get(base + "/slots") as r:
            data = json_or_none(await r.read()) if r.status == 200 else None
            slots = data if isinstance(data, list) else None
        metrics_ok, actions_ok = await probe_endpoints(s, base)
    flags_from = "command line" if argv is not None else "unknown"
    if argv is None:  # a patched server reports its own launch (patches/0009)
        caps = props.get("ocache")
        argv = argv_from_launch(caps.get("launch")) if isinstance(caps, Mapping) else None
        flags_from = "server (/props ocache.launch)" if argv is not None else flags_from
    params = params_from_argv(argv, props, slots)
    findings = check(params, props, slots, argv=argv, metrics_ok=metrics_ok, slot_actions_ok=actions_ok,
                     head_tokens=head_tokens)
    return findings, {"props_build": props.get("build_info"), "slots": len(slots or []),
                      "arch": params.arch, "checkpoints": params.checkpoints, "flags": flags_from}


def offline(argv: Sequence[str], head_tokens: int | None = None) -> tuple[list[Finding], dict]:
    """``check`` on a command line alone (no server): the model's architecture is read from the
    ``-m`` GGUF when it is readable here."""
    params = params_from_argv(argv, None, None)
    findings = check(params, None, None, argv=argv, head_tokens=head_tokens)
    return findings, {"offline": True, "arch": params.arch, "checkpoints": params.checkpoints,
                      "flags": "command line"}
