"""llama-server's launch flags as ocache reads them: one table, one parser, the parameters that
shape reuse (``ServerParams``) and the flags that shape a saved state (the identity's part).

The stock llama-server does not report its launch flags (``docs/llama-server.md`` §16), so they come
from the argv ocache launched it with, the one the configuration declares (``tiers.resident.server_args``,
or ``ocache serve --upstream URL -- ARGS``) or the one a patched server reports (``/props``
``ocache.launch``, patches/0009: ``argv_from_launch``), and from ``/props`` / ``/slots`` for the resolved sizes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ocache.llama.gguf import gguf_architecture, resumes_from_checkpoints

log = logging.getLogger("ocache.llama.flags")

# Every llama-server launch flag ocache reads: those that shape the KV / recurrent state a slot holds
# or where context checkpoints land, and those the planner, the tiers and the supervisor need.
# (field, option spellings, kind, default in the pinned source, env var) - common/arg.cpp and
# common/common.h of src-832db069; env vars apply first and the command line overrides them
# (common/arg.cpp:771-880).
_FLAG_SPECS: tuple[tuple[str, tuple[str, ...], str, Any, str | None], ...] = (
    ("ctx_size", ("-c", "--ctx-size"), "int", 0, "LLAMA_ARG_CTX_SIZE"),  # common.h:452, 0 = n_ctx_train
    ("n_parallel", ("-np", "--parallel"), "int", -1, "LLAMA_ARG_N_PARALLEL"),  # arg.cpp:1403 (auto)
    ("kv_unified", ("-kvu", "--kv-unified"), "true", False, "LLAMA_ARG_KV_UNIFIED"),  # common.h:575
    ("kv_unified", ("-no-kvu", "--no-kv-unified"), "false", False, None),
    ("kv_unified_per_slot", ("--kv-unified-per-slot",), "int", 0, "LLAMA_ARG_KV_UNIFIED_PER_SLOT"),  # common.h:632
    ("n_batch", ("-b", "--batch-size"), "int", 2048, "LLAMA_ARG_BATCH"),  # common.h:453
    ("n_ubatch", ("-ub", "--ubatch-size"), "int", 512, "LLAMA_ARG_UBATCH"),  # common.h:454
    ("cache_type_k", ("-ctk", "--cache-type-k"), "str", "f16", "LLAMA_ARG_CACHE_TYPE_K"),  # common.h:343
    # -ctv's env var really is LLAMA_ARG_DEFRAG_THOLD in the pinned source (arg.cpp:2450-2461)
    ("cache_type_v", ("-ctv", "--cache-type-v"), "str", "f16", "LLAMA_ARG_DEFRAG_THOLD"),  # common.h:344
    ("flash_attn", ("-fa", "--flash-attn"), "fa", "auto", "LLAMA_ARG_FLASH_ATTN"),  # common.h:501
    ("swa_full", ("--swa-full",), "true", False, "LLAMA_ARG_SWA_FULL"),  # common.h:574
    ("ctx_checkpoints", ("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints"), "int", 32,
     "LLAMA_ARG_CTX_CHECKPOINTS"),  # common.h:631
    ("checkpoint_min_step", ("-cms", "--checkpoint-min-step"), "int", 8192,
     "LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT"),  # common.h:633
    ("kv_offload", ("-kvo", "--kv-offload"), "true", True, "LLAMA_ARG_KV_OFFLOAD"),  # common.h:580
    ("kv_offload", ("-nkvo", "--no-kv-offload"), "false", True, None),
    ("rope_scaling", ("--rope-scaling",), "str", None, "LLAMA_ARG_ROPE_SCALING_TYPE"),
    ("rope_scale", ("--rope-scale",), "str", None, "LLAMA_ARG_ROPE_SCALE"),
    ("rope_freq_base", ("--rope-freq-base",), "str", None, "LLAMA_ARG_ROPE_FREQ_BASE"),
    ("rope_freq_scale", ("--rope-freq-scale",), "str", None, "LLAMA_ARG_ROPE_FREQ_SCALE"),
    ("yarn_orig_ctx", ("--yarn-orig-ctx",), "str", None, "LLAMA_ARG_YARN_ORIG_CTX"),
    ("yarn_ext_factor", ("--yarn-ext-factor",), "str", None, "LLAMA_ARG_YARN_EXT_FACTOR"),
    ("yarn_attn_factor", ("--yarn-attn-factor",), "str", None, "LLAMA_ARG_YARN_ATTN_FACTOR"),
    ("yarn_beta_slow", ("--yarn-beta-slow",), "str", None, "LLAMA_ARG_YARN_BETA_SLOW"),
    ("yarn_beta_fast", ("--yarn-beta-fast",), "str", None, "LLAMA_ARG_YARN_BETA_FAST"),
    # adapters change every layer's output, hence the KV
    ("lora", ("--lora", "--lora-scaled"), "list", (), None),
    ("control_vector", ("--control-vector", "--control-vector-scaled"), "list", (), None),
    ("override_kv", ("--override-kv",), "list", (), None),
    ("model_draft", ("-md", "--model-draft", "--spec-draft-model"), "str", None, None),
    # not state-shaping: what the planner, the tiers, the checks and the supervisor read
    ("cache_ram", ("-cram", "--cache-ram"), "int", 8192, "LLAMA_ARG_CACHE_RAM"),  # common.h:634, arg.cpp:1716
    ("cache_idle_slots", ("--cache-idle-slots",), "true", True, "LLAMA_ARG_CACHE_IDLE_SLOTS"),  # arg.cpp:1732
    ("cache_idle_slots", ("--no-cache-idle-slots",), "false", True, None),
    ("slot_save_path", ("--slot-save-path",), "str", None, None),  # common.h:694, arg.cpp:3614
    ("metrics", ("--metrics",), "true", False, "LLAMA_ARG_ENDPOINT_METRICS"),  # common.h:675, arg.cpp:3592
    ("slot_prompt_similarity", ("-sps", "--slot-prompt-similarity"), "float", 0.1, None),  # common.h:697
    ("model_path", ("-m", "--model"), "str", None, "LLAMA_ARG_MODEL"),  # arg.cpp:3035
    ("host", ("--host",), "str", "127.0.0.1", "LLAMA_ARG_HOST"),  # arg.cpp:3314
    ("port", ("--port",), "int", 8080, "LLAMA_ARG_PORT"),  # common.h:622, arg.cpp:3330
)

_FLAG_BY_OPT = {opt: spec for spec in _FLAG_SPECS for opt in spec[1]}


def _flash_attn(value: str) -> str:
    v = value.strip().lower()
    if v in ("on", "enabled", "true", "1", "yes"):
        return "on"
    if v in ("off", "disabled", "false", "0", "no"):
        return "off"
    if v == "auto":
        return "auto"
    raise ValueError(f"unknown value for --flash-attn: {value!r}")


def _env_bool(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "on", "yes", "enabled")



def given_flags(argv: Sequence[str] | None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The flags a llama-server command line (and ``env``'s ``LLAMA_ARG_*`` values, which the
    command line overrides, common/arg.cpp:771-880) sets, as ``{field: value}``: only those given,
    no defaults. The one parser of llama-server flags in ocache.

    ``argv`` may include the binary as ``argv[0]``; ``--opt value`` and ``--opt=value``; options not
    in the table are skipped. Kinds: ``int``, ``float``, ``str``, ``fa`` ("on"/"off"/"auto"), ``true``
    / ``false`` (a switch), ``list`` (repeatable). Raises ValueError on a missing or malformed value
    of a known option.
    """
    out: dict[str, Any] = {}
    if env:
        for name, _opts, kind, _default, env_name in _FLAG_SPECS:
            if env_name and env_name in env:
                out[name] = _convert(name, kind, env[env_name], env_name, env=True)
    args = list(argv or [])
    if args and not args[0].startswith("-"):
        args = args[1:]
    i = 0
    while i < len(args):
        arg = args[i]
        opt, eq, inline = arg.partition("=")
        spec = _FLAG_BY_OPT.get(opt if eq else arg)
        if spec is None:
            i += 1
            continue
        name, _opts, kind, _default, _env = spec
        if kind in ("true", "false"):
            out[name] = kind == "true"
            i += 1
            continue
        if eq:
            raw = inline
            i += 1
        else:
            if i + 1 >= len(args):
                raise ValueError(f"llama-server option {arg} needs a value")
            raw = args[i + 1]
            i += 2
        value = _convert(name, kind, raw, opt if eq else arg)
        out[name] = [*out.get(name, []), value] if kind == "list" else value
    return out


def _convert(name: str, kind: str, raw: str, what: str, env: bool = False) -> Any:
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
    except ValueError:
        raise ValueError(f"llama-server option {what}: not a number: {raw!r}") from None
    if kind == "fa":
        return _flash_attn(raw)
    if kind in ("true", "false"):
        return _env_bool(raw)
    if kind == "list" and env:
        return [raw]
    return raw


def parse_flags(argv: Sequence[str] | None, env: Mapping[str, str] | None = None) -> dict:
    """Every field of the flag table for a llama-server command line: ``given_flags`` over the
    pinned source's defaults. ``ctx_size`` is total tokens (0 = the model's n_ctx_train);
    ``n_parallel`` -1 = auto, which the server turns into 4 slots with a unified KV
    (tools/server/server.cpp:156-161), so ``kv_unified`` is True then unless set explicitly. The
    per-slot context is not derivable from argv alone (it depends on n_ctx_train and padding):
    take it from ``/props`` ``default_generation_settings.n_ctx`` (see ``state_flags``). Raises
    ValueError like ``given_flags``."""
    given = given_flags(argv, env)
    out: dict[str, Any] = {}
    for name, _opts, kind, default, _env in _FLAG_SPECS:
        out.setdefault(name, list(default) if kind == "list" else default)
    out.update(given)
    if out["n_parallel"] < 0 and "kv_unified" not in given:
        out["kv_unified"] = True  # server.cpp:156-161
    return out


def state_flags(argv: Sequence[str] | None = None, props: Mapping | None = None,
                config: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> dict:
    """The flags part of the identity, from the sources that actually know them.

    * ``argv``: the launch command line (when ocache launched the server), via ``parse_flags``;
    * ``config``: values from ocache's configuration for an external server (override argv; a
      stock server's /props does not expose launch flags, docs/llama-server.md §16);
    * ``props``: ``/props`` -> ``n_ctx_slot`` = ``default_generation_settings.n_ctx`` (per-slot
      context, server-context.cpp:4008-4016) and ``total_slots`` (the resolved ``-np``).
    """
    flags = parse_flags(argv or [], env=env)
    if config:
        flags.update(config)
    if props:
        dgs = props.get("default_generation_settings") or {}
        if isinstance(dgs, Mapping) and "n_ctx" in dgs:
            flags["n_ctx_slot"] = dgs["n_ctx"]
        if "total_slots" in props:
            flags["total_slots"] = props["total_slots"]
    return flags


#: The flags of ``parse_flags`` that shape a saved slot state, i.e. what makes a state written
#: by one server wrong (or refused) in another (the identity is computed from these
#: *effective* flags only, so the same server started by hand with ``ocache.yaml`` or by ``serve
#: --launch`` is one identity):
#:
#: * ``cache_type_k``/``cache_type_v``: the KV element types stored in the file;
#: * ``flash_attn``: sets the V layout (``v_trans = !flash_attn``; a restore with the other layout is
#:   refused, "incompatible V transposition", src/llama-kv-cache.cpp:2558-2560; v_trans from src/llama-model.cpp:2385);
#: * ``swa_full``: the SWA cache holds every token or only the window;
#: * RoPE/YaRN overrides, ``lora``, ``control_vector``, ``override_kv``: they change the K/V values;
#: * ``model_draft``: the patched sidecar stores the draft context's checkpoint blobs (patches/0001).
#:
#: Not state-shaping, hence ignored: ``ctx_size``, ``n_parallel``, ``kv_unified``,
#: ``kv_unified_per_slot``, ``n_batch``, ``n_ubatch``, ``ctx_checkpoints``, ``checkpoint_min_step``,
#: ``kv_offload`` and ``/props``' ``n_ctx_slot``/``total_slots``: a slot file holds one sequence's
#: cells with their positions (``llama_state_seq_get_data``), restorable into any slot with room
#: whatever the slot count, unified KV, batch sizes, checkpoint spacing or where the cache lives (a
#: state that does not fit is refused, "not enough cells", src/llama-kv-cache.cpp:2553-2556), and ocache
#: never offers a state longer than the request it serves, which must fit the slot.
IDENTITY_FLAGS: tuple[str, ...] = (
    "cache_type_k", "cache_type_v", "flash_attn", "swa_full", "rope_scaling", "rope_scale",
    "rope_freq_base", "rope_freq_scale", "yarn_orig_ctx", "yarn_ext_factor", "yarn_attn_factor",
    "yarn_beta_slow", "yarn_beta_fast", "lora", "control_vector", "override_kv", "model_draft",
)
_IDENTITY_DEFAULTS = {name: (list(default) if kind == "list" else default)
                      for name, _opts, kind, default, _env in _FLAG_SPECS}


def _number_or_text(v: Any) -> Any:
    """``"20000"``, ``"20000.0"`` and ``20000`` are one RoPE value; other text stays as given."""
    if v is None or isinstance(v, bool):
        return v
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v).strip()
    return repr(f)


def identity_flags(flags: Mapping[str, Any]) -> dict:
    """The effective, state-shaping part of ``flags`` (``parse_flags``/``state_flags`` output,
    or any subset of it): only ``IDENTITY_FLAGS``, defaults of the pinned source filled in for the
    absent ones, aliases normalised (``-fa enabled`` = ``on``; cache types lower case; RoPE/YaRN
    numbers compared as numbers). ``flash_attn: auto`` counts as ``on``: the pinned source resolves
    auto to enabled wherever the device supports the flash-attention op (the probe in
    src/llama-context.cpp:557-559; always on the CPU backend, and forced on by a quantized V cache,
    src/llama-context.cpp:3840-3843); where a device resolves it to off, the restore of a state written with
    it on is refused by the server (see ``IDENTITY_FLAGS``) and ocache serves that request cold."""
    out: dict[str, Any] = {}
    for name in IDENTITY_FLAGS:
        v = flags.get(name, _IDENTITY_DEFAULTS.get(name))
        if name == "flash_attn":
            v = _flash_attn(str(v)) if v is not None else "auto"
            v = "on" if v == "auto" else v
        elif name in ("cache_type_k", "cache_type_v"):
            v = str(v).strip().lower() if v is not None else None
        elif name == "swa_full":
            v = bool(v)
        elif name in ("lora", "control_vector", "override_kv"):
            v = [str(x) for x in (v or [])]
        elif name != "model_draft":
            v = _number_or_text(v)
        out[name] = v
    return out


@dataclass(frozen=True)
class ServerParams:
    """The llama-server settings that shape reuse. Launch flags are not reported by the stock server
    (docs/llama-server.md §16; the patched one reports its argv, patches/0009), so they come from the
    launch argv (``params_from_argv``) and ``/props``/``/slots``.

    ``n_batch``/``n_ubatch``: ``-b``/``-ub`` in tokens (checkpoints land on batch breaks; resume
    granularity is one ubatch). ``ctx_checkpoints``/``checkpoint_min_step``: ``--ctx-checkpoints`` /
    ``--checkpoint-min-step`` (defaults 32 / 8192, common/arg.cpp:1697-1714). ``checkpoints``:
    whether the model resumes from checkpoints (recurrent/hybrid arch); ``None`` = unknown.
    ``cache_ram``: ``--cache-ram`` MiB (0 = off; otherwise a pinned slot may be swapped with a RAM
    entry, docs/llama-server.md §9 step 4). ``n_slots``/``n_ctx_slot``: from ``/slots``.
    """

    n_slots: int = 1
    n_ctx_slot: int = 4096
    n_batch: int = 2048
    n_ubatch: int = 512
    ctx_checkpoints: int = 32
    checkpoint_min_step: int = 8192
    checkpoints: bool | None = None
    cache_ram: int = 8192
    kv_unified: bool | None = None
    cache_idle_slots: bool = True
    slot_save_path: str | None = None
    metrics: bool | None = None
    n_parallel_explicit: bool | None = None
    slot_prompt_similarity: float = 0.1
    flash_attn: str | None = None
    model_path: str | None = None
    arch: str | None = None
    known: frozenset = frozenset()  # names of the fields that came from the argv (not defaults)

    @property
    def hybrid(self) -> bool:
        return bool(self.checkpoints)


def params_from_argv(argv: Sequence[str] | None, props: Mapping | None = None,
                     slots: Sequence[Mapping] | None = None, **override: Any) -> ServerParams:
    """Build ``ServerParams`` from the launch argv (may be None: llama defaults are assumed and
    ``known`` stays empty), ``/props`` (model path) and ``/slots`` (slot count, per-slot n_ctx).

    ``checkpoints`` is decided from the GGUF architecture (``gguf_architecture``) when the model
    file is readable here, else left None; ``override`` sets any field explicitly (config wins).
    """
    flags = given_flags(argv or [])
    kw: dict[str, Any] = {}
    for name in ("n_batch", "n_ubatch", "ctx_checkpoints", "checkpoint_min_step", "cache_ram",
                 "kv_unified", "cache_idle_slots", "slot_save_path", "metrics",
                 "slot_prompt_similarity", "flash_attn", "model_path"):
        if name in flags:
            kw[name] = flags[name]
    if argv is not None:
        kw.setdefault("metrics", False)
    if "n_parallel" in flags:
        kw["n_slots"] = flags["n_parallel"]
        kw["n_parallel_explicit"] = flags["n_parallel"] > 0
        if flags["n_parallel"] > 0:
            kw.setdefault("kv_unified", False)
    elif argv is not None:
        # -np unset ("auto") => 4 slots with a unified KV (server.cpp:156-161, docs/llama-server.md §9)
        kw["n_parallel_explicit"] = False
        kw.setdefault("kv_unified", True)
    if "n_ubatch" in kw and "n_batch" not in kw:
        kw["n_batch"] = max(2048, kw["n_ubatch"])
    if props:
        kw.setdefault("model_path", props.get("model_path"))
        if props.get("total_slots"):
            kw["n_slots"] = int(props["total_slots"])
        n_ctx = (props.get("default_generation_settings") or {}).get("n_ctx")
        if n_ctx:
            kw["n_ctx_slot"] = int(n_ctx)
    if slots:
        kw["n_slots"] = len(slots)
        if slots[0].get("n_ctx"):
            kw["n_ctx_slot"] = int(slots[0]["n_ctx"])
    kw["known"] = frozenset(k for k in flags)
    kw.update(override)
    if kw.get("checkpoints") is None and kw.get("arch") is None and kw.get("model_path"):
        try:
            kw["arch"] = gguf_architecture(kw["model_path"])
        except (OSError, ValueError) as exc:
            log.debug("cannot read the GGUF architecture of %s: %s", kw["model_path"], exc)
    if kw.get("checkpoints") is None and kw.get("arch"):
        kw["checkpoints"] = resumes_from_checkpoints(kw["arch"])
    return ServerParams(**kw)


_PATH_OPTS = frozenset({"--slot-save-path", "-m", "--model", "-md", "--model-draft", "--spec-draft-model",
                        "--lora", "--control-vector", "--chat-template-file"})


def argv_from_launch(launch: Mapping[str, Any] | None) -> list[str] | None:
    """The launch flags of a patched llama-server as one command line, from ``/props``
    ``ocache.launch`` (patches/0009: ``{"argv": [...], "env": {LLAMA_ARG_*: ...}, "cwd": dir}``), or
    None for a server that does not report them (stock, or a patched build without 0009).

    The ``LLAMA_ARG_*`` values of the table come first, as the options they stand for (the command
    line overrides them, common/arg.cpp:771-880, and ``given_flags`` lets a later option win), then
    the argv without its binary; the values of path options (``--slot-save-path``, ``-m``, ...) that
    are relative are made absolute against the server's ``cwd``, since ocache runs elsewhere.
    Malformed input (not a list of strings) is None: the flags are then unknown, as on a stock build.
    """
    if not isinstance(launch, Mapping) or not isinstance(launch.get("argv"), list) \
            or not all(isinstance(a, str) for a in launch["argv"]):
        return None
    env_given, cwd_given = launch.get("env"), launch.get("cwd")
    env: Mapping[str, Any] = env_given if isinstance(env_given, Mapping) else {}
    cwd: str = cwd_given if isinstance(cwd_given, str) else ""
    out: list[str] = []
    for name, opts, kind, _default, env_name in _FLAG_SPECS:
        if not env_name or not isinstance(env.get(env_name), str):
            continue
        raw = env[env_name]
        if kind == "true":
            if _env_bool(raw):
                out.append(opts[-1])
            else:
                off = next((s for s in _FLAG_SPECS if s[0] == name and s[2] == "false"), None)
                if off is not None:
                    out.append(off[1][-1])
        elif kind != "false":
            out += [opts[-1], raw]
    args = list(launch["argv"][1:])
    for i, arg in enumerate(args):
        opt, eq, inline = arg.partition("=")
        if eq and opt in _PATH_OPTS:
            args[i] = f"{opt}={_absolute(inline, cwd)}"
        elif arg in _PATH_OPTS and i + 1 < len(args):
            args[i + 1] = _absolute(args[i + 1], cwd)
    return out + args


def _absolute(path: str, cwd: str) -> str:
    import os.path

    p = os.path.expanduser(path)
    return p if os.path.isabs(p) or not cwd else os.path.normpath(os.path.join(cwd, p))
