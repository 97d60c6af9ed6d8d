"""Tier wiring, apart from the per-request path: the layer's options from the config, the server's
identity, the tiers built from the config when the layer gets ready (``OCacheLayer.ensure_ready``).

Each builder returns None when its tier cannot work (logged once) and never raises: a tier that
fails to set up stays off, the layer serves without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Sequence

from ocache import fingerprint as fp_mod
from ocache.llama import flags as llama_flags, gguf as llama_gguf
from ocache.config import tier_key
from ocache.llama.flags import ServerParams

log = logging.getLogger("ocache.cache")


@dataclass(frozen=True)
class LayerOptions:
    """``tiers.resident`` keys the layer reads (``ocache serve --help-config``): ``warm`` (head
    warm-up, default true), ``keep_origin`` (default true), ``reconcile`` (default true),
    ``server_args`` (the argv of a server ocache did not launch; else ``config.launch``),
    ``known`` (default true: a known conversation's next turn is forwarded before its token
    view, ``ocache/cache/routes/known.py``), and any ``ServerParams`` field as an override
    (``n_ubatch``, ``checkpoints``, ...)."""

    warm: bool = True
    keep_origin: bool = True
    reconcile: bool = True
    argv: tuple[str, ...] | None = None
    param_overrides: tuple[tuple[str, Any], ...] = ()
    known: bool = True


def layer_options(config: Any) -> LayerOptions:
    tiers_cfg = dict((getattr(config, "tiers", None) or {}).get("resident") or {})
    warm = bool(tiers_cfg.pop("warm", True))
    keep_origin = bool(tiers_cfg.pop("keep_origin", True))
    reconcile = bool(tiers_cfg.pop("reconcile", True))
    known = bool(tier_key(tiers_cfg, "resident", "known", True))   # its former name: fast_path
    tiers_cfg.pop("known", None)
    tiers_cfg.pop("fast_path", None)
    overrides = tuple((k, v) for k, v in tiers_cfg.items() if k in ServerParams.__dataclass_fields__)
    server_args = tiers_cfg.pop("server_args", None)
    argv = list(server_args or getattr(config, "launch", None) or []) or None
    return LayerOptions(warm, keep_origin, reconcile, tuple(argv) if argv else None, overrides, known)


def server_identity(props: Any, argv: Sequence[str] | None) -> Any:
    """The server's identity (``ocache.fingerprint.identity``) from ``/props`` and the launch argv:
    GGUF header and whole-file digest (unreadable file: None; a file version never digested: its
    provisional identity, ``GGUFIdentity.pending``), build, chat templates, state-shaping flags."""
    props = props or {}
    flags = llama_flags.state_flags(argv, props)
    path = props.get("model_path")
    try:
        gguf = llama_gguf.gguf_identity(path, digest=False) if path else None
    except (OSError, ValueError):
        gguf = None
    return fp_mod.identity(gguf, props.get("build_info", ""), props.get("chat_template", ""), flags,
                           props.get("chat_template_tool_use"))


def sync_store_identity(tiers: Sequence[Any], key: str | None) -> None:
    """Tell the tiers' store the server's identity (re)computed from the fresh ``/props``: after a
    restart with another model or flags only that identity's entries are served, the others stay on
    disk (``Store.set_identity``); the session tier's resume marker is checked against it too."""
    stores = {id(s): s for s in (getattr(t, "store", None) for t in tiers) if s is not None}
    if key:
        for store in stores.values():
            store.set_identity(key)


def build_session_tier(config: Any, table: Any, identity: Any) -> Any:
    """``ocache.tiers.spill.make_session_tier`` (None: off, see there)."""
    from ocache.tiers.spill import make_session_tier

    try:
        return make_session_tier(config, table, identity)
    except Exception:
        log.exception("session tier setup failed; it stays off")
        return None


def build_disk_tier(config: Any, table: Any, identity_fn: Any) -> Any:
    """``ocache.tiers.disk.make_disk_tier`` (None: off, see there); ``identity_fn`` is re-read
    before every lookup and write."""
    from ocache.tiers.disk import make_disk_tier

    try:
        return make_disk_tier(config, table, identity_fn, ubatch=table.params.n_ubatch)
    except Exception:
        log.exception("disk tier setup failed; it stays off")
        return None


async def build_remote_tier(config: Any, table: Any, tiers: Sequence[Any]) -> Any:
    """``ocache.tiers.remote.open_remote_tier`` over the local store of the disk/session tiers, when
    ``store.remote`` is configured (None: not configured, no local store, or it failed: logged)."""
    store = next((t.store for t in tiers if getattr(t, "name", "") in ("disk", "session")), None)
    if not ((getattr(config, "store", None) or {}).get("remote") or {}).get("url"):
        return None
    if store is None:
        log.warning("remote tier off: no local store (the disk and session tiers are off)")
        return None
    try:
        from ocache.tiers.remote import open_remote_tier

        return await open_remote_tier(config, store, table)
    except Exception:
        log.exception("remote tier setup failed; it stays off")
        return None


class BuiltTiers:
    """The disk, session and remote tiers built from the config once the server is known, each
    once per layer; one that could not be built (a stock server reports no slot-save folder) is
    tried again when the layer gets ready for the next server process, and the remote tier once
    more after one of the others was built. ``tiers``: the layer's list of registered tiers; each
    tier built here is appended to it."""

    def __init__(self, tiers: list[Any]) -> None:
        self.tiers = tiers
        self.session: Any = None
        self.disk: Any = None
        self._remote_tried = False

    async def ready(self, config: Any, table: Any, identity_fn: Any, *, no_save: bool,
                    prefill_tps_of: Any, upstream: Any = None) -> None:
        """Called when the layer gets ready for a process, under its ready lock (requests wait):
        the session tier (registered once when the server can save slots, then the conversation a
        drained stop left restored before any request is planned: a restore never races a
        prefill); the disk tier (once, when the slot-save-path is known: config
        ``tiers.disk.slot_save_path`` or the launch argv); the remote tier (once, after the tiers
        whose store it shares, ``store.remote``; its downloads' deadlines priced by
        ``prefill_tps_of()``, tokens/s); then the session tier's live saves when
        ``tiers.session.live_save`` asks for them (``remote``: when the remote tier is on), paced by
        ``upstream``'s completions in flight (``Upstream.generating``, ``quiet``).
        ``identity_fn()``: the server's current ``Identity``."""
        built = False
        if self.session is None:   # tried again for each server process: a stock server replaced
            self.session = build_session_tier(config, table, identity_fn())   # by the patched one
            if self.session is not None:
                self.tiers.append(self.session)
                built = True
        if self.session is not None:
            await self.session.after_start()
        if self.disk is None and not no_save:
            self.disk = build_disk_tier(config, table, identity_fn)
            if self.disk is not None:
                self.tiers.append(self.disk)
                built = True
        if not self._remote_tried or (built and not any(t.name == "remote" for t in self.tiers)):
            self._remote_tried = True
            remote = await build_remote_tier(config, table, self.tiers)
            if remote is not None:
                remote.prefill_tps_of = prefill_tps_of
                self.tiers.append(remote)
            live = self.session.live if self.session is not None else None
            mode = self.session.cfg.live_save if self.session is not None else "off"
            if live is not None and (mode == "on" or (mode == "remote" and remote is not None)):
                live.enable(lambda: int(getattr(upstream, "generating", 0) or 0), getattr(upstream, "quiet", None))
                log.info("session: live saves on (after each turn, %g s after the last request)", live.quiet_s)


    def arrived(self) -> None:
        """A request arrived: a live save waits for the next quiet moment (``ocache/tiers/live.py``)."""
        if self.session is not None:
            self.session.live.arrived()

    def stop_live(self) -> None:
        """A planned stop began: no live save starts from now on."""
        if self.session is not None:
            self.session.live.stop()


def checked_params(params: ServerParams, config: Any) -> ServerParams:
    """``params`` for the setup checks, with the slot-save folder the config gives
    (``config.slot_save_path``) where the launch flags do not say it: the checks then see the
    folder the tiers use."""
    if params.slot_save_path is None:
        from ocache.config import slot_save_path

        with contextlib.suppress(ValueError):
            known = slot_save_path(config, params)
            if known is not None:
                params = dataclasses.replace(params, slot_save_path=str(known))
    return params


async def setup_findings(session: Any, base_url: str, headers: dict, params: ServerParams, props: Any,
                         slots: Any, argv: Sequence[str] | None) -> tuple[list, bool | None] | None:
    """``ocache.llama.checks``' advice on the server's setup (each non-ok finding logged) and
    whether its slot actions work (False: no ``--slot-save-path``); None when the checks could not
    run. Never raises."""
    try:
        from ocache.llama.checks import check, probe_endpoints

        metrics_ok, actions_ok = await probe_endpoints(session, base_url, headers)
        findings = check(params, props or {}, slots, argv=list(argv) if argv else None,
                         metrics_ok=metrics_ok, slot_actions_ok=actions_ok)
        for f in findings:
            if f.level != "ok":
                log.warning("llama-server setup: %s", f)
        return findings, actions_ok
    except Exception:  # the checks are advice; never block serving
        log.debug("setup checks failed", exc_info=True)
        return None
