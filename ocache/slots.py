"""The slot table: what each llama-server slot holds, and every slot HTTP call ocache makes.

llama-server reuses a prompt only against the slot it lands on (``docs/llama-server.md``
§9-§11; the § numbers below refer to that file), so ocache keeps its own belief of every slot:

* ``tokens``: the prompt token ids ocache last sent to the slot (or warmed/restored into it). The
  server holds these plus the generated tokens minus the last one (docs/llama-server.md §7); ocache never sees
  the generated ids, so they are only counted (``n_total``).
* ``n_total``: tokens the server says the slot holds (``GET /slots`` ``n_prompt_tokens``,
  docs/llama-server.md §4) or ``len(prompt) + predicted_n - 1`` from a response's ``timings``; ``None`` = unknown
  (a restored slot reports no ``n_prompt_tokens`` at all: unknown, not 0).
* ``checkpoints``: the *predicted* context-checkpoint positions of a hybrid/recurrent model,
  simulated with the server's own placement rules (docs/llama-server.md §14, server-context.cpp:3501-3616 and
  ``create_checkpoint`` :2290-2354). They decide how much of a slot a diverging prompt can reuse
  (docs/llama-server.md §15). The server never reports them; the prediction is checked against every response's
  ``cache_n`` by the cache layer.
* owner session key, request kind (agent / guest / other / head), last use, one ``asyncio.Lock``.

Only a slot whose lock ocache holds is ever pinned with ``id_slot`` (a pinned *busy* slot with the
RAM cache on can be overwritten by the server, docs/llama-server.md §9 "Hazard"). The table is reconciled with
``GET /slots`` and voided on a new upstream epoch (a restart empties every slot).

The pure functions (``common_prefix``, ``predict_reuse``, ``simulate_prefill``) carry the model of
the server's reuse rules; they do no I/O so the planner and its unit tests can use them directly.
"""

from __future__ import annotations

import asyncio
import bisect
import copy
import logging
import struct
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import aiohttp

log = logging.getLogger("ocache.slots")

#: GGUF ``general.architecture`` values whose memory cannot be rolled back partially, so the server
#: resumes from context checkpoints (src/llama-arch.cpp ``llm_arch_is_recurrent`` :1071 and
#: ``llm_arch_is_hybrid`` :1085 of the pinned source).
CHECKPOINT_ARCHS = frozenset({
    # recurrent
    "mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7",
    # hybrid
    "jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h",
    "nemotron_h_moe", "qwen3next", "kimi-linear", "bailingmoe3", "kimi-k3", "glm5-next",
    "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "minimax-01",
})


# ----------------------------------------------------------------------------------------------
# errors


class SlotError(RuntimeError):
    """A slot call failed. ``status``: HTTP status (0 = transport error); ``type``/``message``:
    llama-server's error body ``{"error":{"code","message","type"}}`` (server-common.cpp:36-78)."""

    def __init__(self, message: str, status: int = 0, type: str | None = None, slot: int | None = None):
        super().__init__(message)
        self.status = status
        self.type = type
        self.slot = slot


class SlotNotSupported(SlotError):
    """501: the server runs without ``--slot-save-path`` (save/restore/erase are off, docs/llama-server.md §3)
    or without the ``/slots`` endpoint (``--no-slots``)."""


class SlotBusy(SlotError):
    """The slot is processing (or locked by ocache) and the call would wait or race."""


class SlotFileError(SlotError):
    """400 on save/restore: invalid filename, or the file could not be restored (missing, corrupt,
    another model, does not fit). **After a failed restore the slot is erased** (docs/llama-server.md §5)."""


class SlotInvalid(SlotError):
    """400 ``Invalid slot ID`` / ``Invalid action``, or a slot id outside the table."""


class UpstreamError(SlotError):
    """The server answered with an unexpected status (5xx, 503 while loading) or not at all."""


def file_refused(exc: BaseException) -> bool:
    """True when a failed restore means the *file* is bad (delete the entry), False when the server
    could not be asked or failed for another reason (keep it: the file is still valid).

    Only the server's own answer about the file counts: ``SlotFileError`` (400 ``Unable to restore
    slot: ...`` from the patched pre-check or the stock restore, 400 ``Invalid filename``;
    docs/llama-server.md §5). A refused or reset connection, a timeout (``UpstreamError`` with status 0: llama-server
    killed or restarting), a 5xx/503 (loading), ``SlotInvalid`` and ``SlotNotSupported`` say
    nothing about the file."""
    return isinstance(exc, SlotFileError)


def error_from_response(status: int, body: Any, slot: int | None, what: str) -> SlotError:
    """Map a llama-server error response to the matching ``SlotError`` subclass (docs/llama-server.md §5 table)."""
    err = body.get("error") if isinstance(body, dict) else None
    msg = (err or {}).get("message") if isinstance(err, dict) else None
    typ = (err or {}).get("type") if isinstance(err, dict) else None
    text = f"{what} slot {slot}: HTTP {status}: {msg or body!r}"
    if status == 501:
        return SlotNotSupported(text, status, typ, slot)
    if status == 400 and msg and ("slot ID" in msg or "Invalid action" in msg):
        return SlotInvalid(text, status, typ, slot)
    if status == 400 and msg and ("filename" in msg or "restore" in msg):
        return SlotFileError(text, status, typ, slot)
    if status == 500 and msg and "Unable to save slot" in msg:
        return SlotFileError(text, status, typ, slot)
    return UpstreamError(text, status, typ, slot)


# ----------------------------------------------------------------------------------------------
# server parameters


@dataclass(frozen=True)
class ServerParams:
    """The llama-server settings that shape reuse. Launch flags are not reported by the server
    (docs/llama-server.md §16), so they come from the launch argv (``params_from_argv``) and ``/props``/``/slots``.

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


_FLAG_ALIASES: dict[str, tuple[str, str]] = {
    # flag -> (field, kind)
    "-np": ("n_parallel", "int"), "--parallel": ("n_parallel", "int"),
    "-c": ("ctx_size", "int"), "--ctx-size": ("ctx_size", "int"),
    "-b": ("n_batch", "int"), "--batch-size": ("n_batch", "int"),
    "-ub": ("n_ubatch", "int"), "--ubatch-size": ("n_ubatch", "int"),
    "--ctx-checkpoints": ("ctx_checkpoints", "int"), "-ctxcp": ("ctx_checkpoints", "int"),
    "--swa-checkpoints": ("ctx_checkpoints", "int"),
    "--checkpoint-min-step": ("checkpoint_min_step", "int"), "-cms": ("checkpoint_min_step", "int"),
    "--cache-ram": ("cache_ram", "int"), "-cram": ("cache_ram", "int"),
    "--slot-save-path": ("slot_save_path", "str"),
    "-kvu": ("kv_unified", "true"), "--kv-unified": ("kv_unified", "true"),
    "-no-kvu": ("kv_unified", "false"), "--no-kv-unified": ("kv_unified", "false"),
    "--cache-idle-slots": ("cache_idle_slots", "true"),
    "--no-cache-idle-slots": ("cache_idle_slots", "false"),
    "--metrics": ("metrics", "true"),
    "-sps": ("slot_prompt_similarity", "float"), "--slot-prompt-similarity": ("slot_prompt_similarity", "float"),
    "-fa": ("flash_attn", "str"), "--flash-attn": ("flash_attn", "str"),
    "-m": ("model_path", "str"), "--model": ("model_path", "str"),
}


def parse_server_argv(argv: Sequence[str]) -> dict[str, Any]:
    """The reuse-shaping flags of a llama-server command line, as ``{field: value}``.

    Accepts ``--flag value`` and ``--flag=value``; unknown flags are ignored. Fields: see
    ``_FLAG_ALIASES``. Raises ValueError on a flag whose value is missing or not a number.
    """
    out: dict[str, Any] = {}
    args = list(argv)
    i = 0
    while i < len(args):
        a = args[i]
        val: str | None = None
        if a.startswith("-") and "=" in a:
            a, val = a.split("=", 1)
        spec = _FLAG_ALIASES.get(a)
        i += 1
        if spec is None:
            continue
        name, kind = spec
        if kind == "true":
            out[name] = True
            continue
        if kind == "false":
            out[name] = False
            continue
        if val is None:
            if i >= len(args):
                raise ValueError(f"llama-server flag {a} has no value")
            val = args[i]
            i += 1
        try:
            out[name] = int(val) if kind == "int" else float(val) if kind == "float" else val
        except ValueError:
            raise ValueError(f"llama-server flag {a}: {val!r} is not a number") from None
    return out


def params_from_argv(argv: Sequence[str] | None, props: Mapping | None = None,
                     slots: Sequence[Mapping] | None = None, **override: Any) -> ServerParams:
    """Build ``ServerParams`` from the launch argv (may be None: llama defaults are assumed and
    ``known`` stays empty), ``/props`` (model path) and ``/slots`` (slot count, per-slot n_ctx).

    ``checkpoints`` is decided from the GGUF architecture (``gguf_architecture``) when the model
    file is readable here, else left None; ``override`` sets any field explicitly (config wins).
    """
    flags = parse_server_argv(argv or [])
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
        kw["checkpoints"] = kw["arch"] in CHECKPOINT_ARCHS
    return ServerParams(**kw)


_GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_architecture(path: str | Path) -> str:
    """``general.architecture`` of a GGUF file (reads only the metadata header).

    GGUF layout: ``"GGUF" | u32 version | u64 n_tensors | u64 n_kv | kv...``, each kv
    ``u64 len | key | u32 type | value`` (ggml/docs gguf.md). Raises ValueError for a file that is
    not GGUF v2/v3 or has no such key, OSError if unreadable.
    """
    with open(path, "rb") as f:
        head = f.read(24)
        if len(head) < 24 or head[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        version, _n_tensors, n_kv = struct.unpack("<IQQ", head[4:24])
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} unsupported")

        def read(n: int) -> bytes:
            b = f.read(n)
            if len(b) != n:
                raise ValueError(f"{path}: truncated GGUF header")
            return b

        def read_str() -> bytes:
            (n,) = struct.unpack("<Q", read(8))
            return read(n)

        def skip(t: int) -> None:
            if t in _GGUF_SCALAR:
                read(_GGUF_SCALAR[t])
            elif t == 8:
                read_str()
            elif t == 9:
                et, count = struct.unpack("<IQ", read(12))
                if et in _GGUF_SCALAR:
                    f.seek(_GGUF_SCALAR[et] * count, 1)
                else:
                    for _ in range(count):
                        skip(et)
            else:
                raise ValueError(f"{path}: unknown GGUF value type {t}")

        for _ in range(n_kv):
            key = read_str()
            (t,) = struct.unpack("<I", read(4))
            if key == b"general.architecture" and t == 8:
                return read_str().decode()
            skip(t)
    raise ValueError(f"{path}: no general.architecture")


# ----------------------------------------------------------------------------------------------
# pure model of the server's reuse rules


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists (``server_tokens::get_common_prefix``
    for text, server-common.cpp:697-745). Compares 256-token slices at C speed, then scans."""
    n = min(len(a), len(b))
    i = 0
    step = 256
    while i + step <= n and a[i:i + step] == b[i:i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class Checkpoint:
    """A predicted context checkpoint: the state after the first ``n_tokens`` tokens
    (pos_min = pos_max = n_tokens - 1 for a hybrid model, docs/llama-server.md §15). ``task``: ocache's id of the
    request that created it (the server evicts other tasks' close checkpoints first, :2298-2311)."""

    n_tokens: int
    task: int = -1


@dataclass(frozen=True)
class Reuse:
    """The predicted outcome of sending ``n_prompt`` tokens to a slot.

    ``cache_n``: tokens the server will reuse (its ``timings.cache_n``); ``upper``: the most it could
    reuse if the slot's unknown tail (generated tokens ocache did not see, or a RAM-cache swap)
    also matches — an observation in ``[cache_n - ubatch, upper + ubatch]`` is consistent.
    ``lcp``: common prefix with what ocache knows the slot holds. ``checkpoint``: the checkpoint
    resumed from (hybrid) or None. ``reason``: ``cold`` | ``extends`` | ``prefix`` |
    ``checkpoint`` | ``no-checkpoint`` (a hybrid full re-prefill) | ``identical``.
    ``checkpoints_after``: the predicted checkpoint list after the request's prefill.
    """

    cache_n: int
    upper: int
    lcp: int
    n_prompt: int
    checkpoint: int | None
    reason: str
    checkpoints_after: tuple[Checkpoint, ...] = ()


def predict_reuse(slot_tokens: Sequence[int], n_total: int | None, checkpoints: Sequence[Checkpoint],
                  new_tokens: Sequence[int], params: ServerParams, *, user_starts: Iterable[int] = (),
                  task: int = -1, ram_swap: bool = False) -> Reuse:
    """Predict ``cache_n`` for ``new_tokens`` on a slot holding ``slot_tokens`` (+ an unknown tail up
    to ``n_total`` tokens in all; None = unknown length ≥ ``len(slot_tokens)``), and the checkpoint
    list the request's prefill leaves behind.

    Rules (server-context.cpp:3196-3395, docs/llama-server.md §11, §15):
    * ``n_past = LCP(slot, new)``; the unknown tail is assumed not to match (``upper`` allows it);
    * hybrid/recurrent (``params.checkpoints``): if the prompt diverges inside the slot
      (``n_past < slot size``) or is identical, resume from the newest checkpoint with
      ``n_tokens <= n_past`` (``< n_past`` when identical), else from 0; a prompt that strictly
      extends everything the slot holds reuses it all;
    * checkpoints beyond the resume point are erased;
    * at least one token is evaluated: an identical prompt gives ``N - 1`` [TAG_PROMPT_LOGITS].
    ``ram_swap``: the server may swap in a RAM-cache entry (``--cache-ram`` on and the slot's
    ``f_keep < 0.5``, docs/llama-server.md §9 step 4): ``upper`` becomes ``N - 1``.
    """
    N = len(new_tokens)
    held = len(slot_tokens)
    lcp = common_prefix(slot_tokens, new_tokens)
    n_past = lcp
    tail_unknown = n_total is None or n_total > held
    slot_size = held if n_total is None else max(n_total, held)
    if n_total is None and held > 0:
        slot_size = held + 1  # unknown: assume the usual generated tail (at least one token)
    ckpts = list(checkpoints)
    used: int | None = None
    reason = "cold" if lcp == 0 else "prefix"
    upper = lcp
    if tail_unknown and lcp == held and held > 0:
        # the new prompt may continue into the generated tokens ocache never saw
        upper = min(n_total if n_total is not None else N, N)

    if params.checkpoints and n_past > 0 and n_past <= slot_size:
        has_new = n_past < N
        thold = n_past if has_new else n_past - 1
        pos_min = slot_size - 1
        if pos_min >= thold:
            found = None
            for c in reversed(ckpts):
                if c.n_tokens - 1 > n_past:   # cur.pos_max > pos_next
                    continue
                if c.n_tokens - 1 < thold or c.n_tokens - 1 == 0:
                    found = c
                    break
            if found is None:
                n_past = 0
                reason = "no-checkpoint"
            else:
                n_past = min(n_past, found.n_tokens)
                used = found.n_tokens
                reason = "checkpoint"
        else:
            reason = "extends"
    elif n_past > 0 and n_past == held and n_past < N:
        reason = "extends"
    pos_next = n_past
    ckpts = [c for c in ckpts if c.n_tokens - 1 <= pos_next]
    if n_past == N and N > 0:
        n_past -= 1
        reason = "identical"
    if ram_swap:
        upper = max(upper, N - 1)
    upper = max(upper, n_past)
    if params.checkpoints and params.ctx_checkpoints > 0:
        after = simulate_prefill(ckpts, n_past, N, user_starts, params, task)
    else:
        after = ckpts
    return Reuse(n_past, upper, lcp, N, used, reason, tuple(after))


def simulate_prefill(checkpoints: Sequence[Checkpoint], n_past: int, n_prompt: int,
                     user_starts: Iterable[int], params: ServerParams, task: int = -1) -> list[Checkpoint]:
    """The checkpoint list after prefilling tokens ``[n_past, n_prompt)`` on a hybrid model.

    Mirrors the batching loop of server-context.cpp:3504-3616 for one slot with the batch to
    itself: a batch ends at ``n_batch`` tokens, at a user-message start (if it is the last user
    message, the list is empty, or it is more than ``min_step`` past the last checkpoint), and so
    that the last ``4 + n_ubatch`` and ``4`` tokens start batches of their own; a checkpoint of the
    state *before* a batch is taken when the batch starts a user message or is near the prompt end
    (``N < batch_end + n_ubatch``), never at position 0, and only if the list is empty, it is the
    last user message, near the end, or more than ``min_step`` past the last one. The list is
    capped by ``create_checkpoint``'s eviction (:2290-2354). Concurrent prefills on other slots
    share the server batch and can move batch breaks; that is a known source of small error.
    """
    cps = list(checkpoints)
    if params.ctx_checkpoints <= 0:
        return cps
    starts = set(user_starts)
    last_user = max(starts) if starts else -1
    n_batch, n_ubatch, min_step = params.n_batch, params.n_ubatch, params.checkpoint_min_step
    offsets = [min(n_batch, 4 + n_ubatch), min(n_batch, 4)]
    N = n_prompt
    cur = n_past
    if cur >= N:
        return cps
    ordered = sorted(starts)
    breaks = sorted({N - off for off in offsets})
    while cur < N:
        start = cur
        # the server pushes one token at a time and ends the batch at the first position that is
        # a qualifying user start or leaves exactly an offset's worth of tokens; computed directly
        # (the per-token loop costs ~0.3 s per 100k tokens in Python)
        end = min(N, start + n_batch)
        for p in breaks:
            if start < p <= end:
                end = p
                break
        i = bisect.bisect_right(ordered, start)
        while i < len(ordered) and ordered[i] <= end:
            u = ordered[i]
            if u == last_user or not cps or u > cps[-1].n_tokens + min_step:
                end = min(end, u)
                break
            i += 1
        cur = end
        near_end = N < cur + n_ubatch
        is_user_start = start in starts
        do = True
        if cur != N and not is_user_start and not near_end:
            do = False
        if start <= 0:  # pos_min < 0: nothing to checkpoint
            do = False
        do = do and (not cps or start == last_user or near_end or start > cps[-1].n_tokens + min_step)
        if do:
            cps = _create_checkpoint(cps, start, task, params)
    return cps


def _create_checkpoint(cps: list[Checkpoint], n_tokens: int, task: int, params: ServerParams) -> list[Checkpoint]:
    """``create_checkpoint`` (server-context.cpp:2290-2354): when full, drop other tasks'
    checkpoints within min-step of the previous kept one, then the oldest; supersede an entry at
    the same position; append."""
    cap = params.ctx_checkpoints
    out = list(cps)
    last = -1
    i = 0
    while len(out) + 1 >= cap and i < len(out):
        c = out[i]
        if c.task != task and last >= 0 and c.n_tokens <= last + params.checkpoint_min_step:
            del out[i]
            continue
        last = c.n_tokens
        i += 1
    while len(out) >= cap:
        out.pop(0)
    out = [c for c in out if c.n_tokens != n_tokens]
    out.append(Checkpoint(n_tokens, task))
    return out


# ----------------------------------------------------------------------------------------------
# the table


@dataclass
class SlotState:
    """ocache's belief about one slot (see the module docstring). ``seq`` increments on every change
    so a planner can tell whether a snapshot is stale. ``origin``: the slot holds a warmed harness
    head (``head_key``) that no conversation has consumed yet. ``foreign``: the server reported
    something ocache did not send (content unknown)."""

    id: int
    n_ctx: int = 0
    tokens: list[int] = field(default_factory=list)
    n_total: int | None = 0
    checkpoints: list[Checkpoint] = field(default_factory=list)
    user_starts: list[int] = field(default_factory=list)
    owner: str | None = None
    kind: str | None = None
    head_key: str | None = None
    head_len: int = 0
    origin: bool = False
    last_used: float = 0.0
    seq: int = 0
    busy: bool = False
    pending: bool = False   # a request is in flight: n_total will be known after it
    foreign: bool = False
    #: ``RequestContext.labels`` of the conversation held (folder, client, model), for spills
    labels: dict = field(default_factory=dict)
    #: the slot file the content was restored from (``restore``), until anything replaces it
    restored_from: str | None = None

    def clear(self) -> None:
        """The slot is empty (erase, restart, failed restore)."""
        self.tokens = []
        self.n_total = 0
        self.checkpoints = []
        self.user_starts = []
        self.owner = None
        self.kind = None
        self.head_key = None
        self.head_len = 0
        self.origin = False
        self.foreign = False
        self.pending = False
        self.labels = {}
        self.restored_from = None
        self.seq += 1

    def unknown(self, n_total: int | None) -> None:
        """The slot holds something ocache cannot name (foreign use, restored elsewhere)."""
        self.clear()
        self.n_total = n_total
        self.foreign = True


class SlotLease:
    """Ownership of one slot: holds the slot's ``asyncio.Lock`` from :meth:`SlotTable.lease` until
    :meth:`release`, which is idempotent and synchronous, so every exit path (a return, an
    exception, ``asyncio.CancelledError`` at any await) can release it without awaiting; also an
    async context manager. ``held``: the lock is still owned by this lease."""

    __slots__ = ("slot", "_lock", "held")

    def __init__(self, slot: int, lock: asyncio.Lock) -> None:
        self.slot = slot
        self._lock = lock
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self._lock.release()

    async def __aenter__(self) -> "SlotLease":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.release()


class SlotTable:
    """One entry and one ``asyncio.Lock`` per llama-server slot, plus the slot HTTP calls.

    ``session``/``base_url``: the upstream (an aiohttp session and ``http://host:port``).
    ``headers``: extra request headers (e.g. ``Authorization`` for ``--api-key``). Call
    ``refresh()`` once before use (it sizes the table from ``GET /slots``).

    The caller must hold ``lock(slot)`` around ``warm``/``save``/``restore``/``erase`` and any
    request it pins to the slot: that is what makes "pin only idle slots" true.
    """

    def __init__(self, session: aiohttp.ClientSession, base_url: str, params: ServerParams | None = None,
                 *, headers: Mapping[str, str] | None = None, timeout_s: float = 3600.0) -> None:
        self.session = session
        self.base_url = base_url.rstrip("/")
        self.params = params or ServerParams()
        self.headers = dict(headers or {})
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.slots: list[SlotState] = []
        self._locks: list[asyncio.Lock] = []
        self.epoch: Any = None
        self.reconciled_at: float = 0.0
        self.counters: dict[str, int] = {"reconcile_mismatch": 0, "foreign_busy": 0, "restarts": 0,
                                         "restarts_seen_in_slots": 0}
        # highest ``id_task`` each slot reported (GET /slots): within one server process it only
        # grows and never disappears (``task_prev`` is kept, tools/server/server-context.cpp
        # ``server_slot::to_json``), so a slot that loses or lowers it is on a new process
        self._id_task: dict[int, int] = {}
        self._task_seq = 0
        #: per slot: (tokens, ms) ocache itself prefilled there with :meth:`warm`, cumulative
        #: (``timings.prompt_n``/``prompt_ms``); the cache layer takes the delta over a request's
        #: steps to correct the figures that request reports (ocache/api/figures.py)
        self.own_prefill: dict[int, tuple[int, float]] = {}

    # -- table ----------------------------------------------------------------------------------

    def next_task(self) -> int:
        """A fresh request id for the checkpoint model's per-task eviction rule."""
        self._task_seq += 1
        return self._task_seq

    def _ensure(self, n: int, n_ctx: int | None = None) -> None:
        while len(self.slots) < n:
            self.slots.append(SlotState(id=len(self.slots), n_ctx=n_ctx or self.params.n_ctx_slot))
            self._locks.append(asyncio.Lock())
        if n_ctx:
            for s in self.slots:
                s.n_ctx = n_ctx

    def lock(self, slot: int) -> asyncio.Lock:
        self._check(slot)
        return self._locks[slot]

    async def lease(self, slot: int) -> SlotLease:
        """Wait for ``slot``'s lock and return the lease that owns it. A cancellation while waiting
        leaves the lock as it was (``asyncio.Lock.acquire`` takes it only when the wait succeeded)."""
        lock = self.lock(slot)
        await lock.acquire()
        return SlotLease(slot, lock)

    def _check(self, slot: int) -> None:
        if not 0 <= slot < len(self.slots):
            raise SlotInvalid(f"slot {slot} outside 0..{len(self.slots) - 1}", slot=slot)

    def __getitem__(self, slot: int) -> SlotState:
        self._check(slot)
        return self.slots[slot]

    def __len__(self) -> int:
        return len(self.slots)

    def snapshot(self) -> list[SlotState]:
        """Deep copies of every slot's state (for the pure planner); ``busy`` = ocache holds its lock."""
        out = []
        for s, lk in zip(self.slots, self._locks):
            c = copy.copy(s)
            c.tokens = s.tokens  # read-only use; lists are replaced, never mutated in place
            c.checkpoints = list(s.checkpoints)
            c.busy = lk.locked()
            out.append(c)
        return out

    def reset_all(self, epoch: Any = None) -> None:
        """A new upstream process: every slot is empty (docs/llama-server.md §16 restart detection)."""
        for s in self.slots:
            s.clear()
        self.epoch = epoch
        self.counters["restarts"] += 1

    # -- HTTP -----------------------------------------------------------------------------------

    async def _request(self, method: str, path: str, *, json_body: Any = None, slot: int | None = None,
                       what: str = "slot call") -> tuple[int, Any]:
        url = self.base_url + path
        for attempt in (0, 1):
            try:
                async with self.session.request(method, url, json=json_body, headers=self.headers,
                                                timeout=self.timeout) as resp:
                    try:
                        body = await resp.json(content_type=None)
                    except (ValueError, aiohttp.ContentTypeError):
                        body = {"error": {"message": (await resp.text())[:500]}}
                    return resp.status, body
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientConnectionResetError) as exc:
                # llama-server closes idle keep-alive connections; a pooled one can be dead before
                # the request is read. Every slot call is safe to send again (save/restore/erase
                # replace state, a warm-up prefills the same tokens), so retry once.
                if attempt == 0:
                    continue
                raise UpstreamError(f"{what} {method} {path}: {exc!r}", 0, None, slot) from exc
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                raise UpstreamError(f"{what} {method} {path}: {exc!r}", 0, None, slot) from exc
        raise AssertionError("unreachable")

    async def fetch_slots(self) -> list[dict]:
        """``GET /slots`` (docs/llama-server.md §4). Raises SlotNotSupported (501, ``--no-slots``) or UpstreamError."""
        status, body = await self._request("GET", "/slots", what="GET /slots")
        if status != 200 or not isinstance(body, list):
            raise error_from_response(status, body, None, "GET /slots")
        return body

    async def refresh(self) -> list[dict]:
        """``GET /slots`` and reconcile: size the table, then for each slot ocache does not hold the
        lock for, compare ``n_prompt_tokens`` with the belief. A missing key means "never ran a
        task": unknown content if ocache thinks it holds something restored, else empty. A slot the
        server reports processing without ocache's lock is foreign use (content unknown)."""
        data = await self.fetch_slots()
        n_ctx = int(data[0].get("n_ctx") or 0) if data else 0
        self._ensure(len(data), n_ctx or None)
        if self._restarted(data):
            # a restart the upstream's probe has not seen yet (it polls every 2 s): a restored
            # slot of the old process looks exactly like a fresh empty one, so trust nothing
            log.warning("GET /slots shows a new llama-server process (a slot's id_task vanished "
                        "or went back): every slot is empty")
            self.counters["restarts_seen_in_slots"] += 1
            self.reset_all(self.epoch)
        if data and (self.params.n_slots != len(data) or (n_ctx and self.params.n_ctx_slot != n_ctx)):
            self.params = replace(self.params, n_slots=len(data), n_ctx_slot=n_ctx or self.params.n_ctx_slot)
        for entry in data:
            sid = int(entry.get("id", -1))
            if not 0 <= sid < len(self.slots):
                continue
            if self._locks[sid].locked():
                continue  # ocache is using it; its belief is being updated by the user of the lock
            st = self.slots[sid]
            self.reconcile_one(st, entry)
        self.reconciled_at = time.monotonic()
        return data

    def _restarted(self, data: list[dict]) -> bool:
        """Whether ``GET /slots`` comes from another process than the last one (see
        ``_id_task``); records the ids either way."""
        seen = {int(e.get("id", -1)): e.get("id_task") for e in data}
        restarted = any(sid in self._id_task and (t is None or int(t) < self._id_task[sid])
                        for sid, t in seen.items())
        if restarted:
            self._id_task.clear()
        for sid, t in seen.items():
            if t is not None:
                self._id_task[sid] = max(int(t), self._id_task.get(sid, -1))
        return restarted

    def reconcile_one(self, st: SlotState, entry: Mapping) -> None:
        """Reconcile one idle slot's belief with its ``GET /slots`` entry (docs/llama-server.md §4 caveats)."""
        if entry.get("is_processing"):
            self.counters["foreign_busy"] += 1
            st.unknown(None)
            return
        n = entry.get("n_prompt_tokens")
        if n is None:
            # never ran a task: empty, or restored (restore does not set the key). ocache knows
            # which when it did the restore itself (n_total set, foreign False).
            if st.tokens and st.n_total == len(st.tokens) and not st.pending:
                return
            if st.tokens or st.n_total:
                self.counters["reconcile_mismatch"] += 1
                st.unknown(None)
            return
        n = int(n)
        if st.pending or st.n_total is None:
            if n >= len(st.tokens):
                st.n_total = n
                st.pending = False
                return
        elif n == st.n_total:
            return
        if n == 0:
            if st.tokens or st.n_total:
                self.counters["reconcile_mismatch"] += 1
            st.clear()
            return
        self.counters["reconcile_mismatch"] += 1
        log.info("slot %d: server holds %d tokens, ocache believed %s; content now unknown",
                 st.id, n, st.n_total)
        st.unknown(n)

    async def _slot_action(self, slot: int, action: str, body: dict | None) -> dict:
        self._check(slot)
        status, data = await self._request("POST", f"/slots/{slot}?action={action}", json_body=body,
                                           slot=slot, what=action)
        if status != 200 or not isinstance(data, dict):
            raise error_from_response(status, data, slot, action)
        return data

    @staticmethod
    def _check_filename(filename: str) -> None:
        """The subset of ``fs_validate_filename`` (common.cpp:796-868) that ocache's own names could
        break; the server checks the rest (400 ``Invalid filename`` -> SlotFileError)."""
        bad = set(':*?"<>|/\\')
        if (not filename or len(filename.encode()) > 255 or any(c in bad or ord(c) < 32 for c in filename)
                or ".." in filename or filename.endswith(".") or filename != filename.strip(" ")):
            raise SlotFileError(f"invalid slot file name {filename!r}", 400)

    async def save(self, slot: int, filename: str) -> dict:
        """``POST /slots/{slot}?action=save`` -> ``{"n_saved": tokens, "n_written": bytes, ...}``
        (docs/llama-server.md §5). Does not change what the slot holds. Raises SlotNotSupported (no
        ``--slot-save-path``), SlotFileError, UpstreamError."""
        self._check_filename(filename)
        return await self._slot_action(slot, "save", {"filename": filename})

    async def restore(self, slot: int, filename: str, tokens: Sequence[int] | None = None,
                      checkpoints: Sequence[Checkpoint] | None = None) -> dict:
        """``POST /slots/{slot}?action=restore`` -> ``{"n_restored": tokens, "n_read": bytes, ...}``.

        ``tokens``: the token ids the file holds (the caller knows them from its index or the file
        header), recorded as the slot's content; ``checkpoints``: the checkpoints the slot had when
        the file was saved; the patched server's sidecar restores the newest ``n_checkpoints`` of
        them, a stock build none (docs/llama-server.md §6). On failure a stock server has erased the slot
        (docs/llama-server.md §5), the patched pre-check leaves it untouched; the table follows ``GET /slots``.
        """
        self._check_filename(filename)
        st = self.slots[slot]
        try:
            data = await self._slot_action(slot, "restore", {"filename": filename})
        except SlotError:
            # stock: the slot was erased; patched (0002-restore-precheck): a file rejected by the
            # pre-check leaves the slot as it was. Ask the server which one happened.
            before = st.n_total
            try:
                entry = (await self.fetch_slots())[slot]
                held = entry.get("n_prompt_tokens")
            except (SlotError, IndexError):
                held = None
            if not (before and held == before):
                st.clear()
            raise
        n = int(data.get("n_restored", 0))
        st.clear()
        if tokens is not None and len(tokens) == n:
            st.tokens = list(tokens)
            st.n_total = n
            # the patched build reports how many checkpoints its sidecar brought back (the newest
            # ones); a stock build restores none (docs/llama-server.md §6)
            n_ck = data.get("n_checkpoints")
            ck = list(checkpoints or [])
            st.checkpoints = (ck[-int(n_ck):] if n_ck else []) if n_ck is not None else []
        else:
            st.unknown(n)
        st.restored_from = filename
        st.last_used = time.monotonic()
        return data

    async def erase(self, slot: int) -> dict:
        """``POST /slots/{slot}?action=erase`` -> ``{"n_erased": tokens}``; the slot is empty after."""
        data = await self._slot_action(slot, "erase", None)
        self.slots[slot].clear()
        return data

    async def warm(self, slot: int, tokens: Sequence[int], *, message_delimiters: list | None = None,
                   user_starts: Sequence[int] = ()) -> dict:
        """Prefill ``tokens`` into ``slot`` without generating: ``POST /completion`` with the token ids
        as prompt, ``n_predict: 0``, ``id_slot`` pinned, ``cache_prompt: true``. The server samples
        one token but never decodes it, so the slot then holds exactly ``tokens`` (docs/llama-server.md §13).

        Returns the response's ``timings`` (``cache_n``/``prompt_n`` tokens, ``prompt_ms``).
        Raises UpstreamError (e.g. 400 ``exceed_context_size_error``) with the slot left as the
        server left it (content unknown).
        """
        self._check(slot)
        st = self.slots[slot]
        tokens = list(tokens)
        task = self.next_task()
        pred = predict_reuse(st.tokens, st.n_total, st.checkpoints, tokens, self.params,
                             user_starts=user_starts if message_delimiters else (), task=task)
        body: dict[str, Any] = {"prompt": tokens, "n_predict": 0, "id_slot": slot, "cache_prompt": True,
                                "stream": False}
        if message_delimiters:
            body["message_delimiters"] = message_delimiters
        status, data = await self._request("POST", "/completion", json_body=body, slot=slot, what="warm")
        if status != 200 or not isinstance(data, dict):
            st.unknown(None)
            raise error_from_response(status, data, slot, "warm")
        st.clear()
        st.tokens = tokens
        st.n_total = len(tokens)
        st.checkpoints = list(pred.checkpoints_after)
        st.user_starts = list(user_starts)
        st.last_used = time.monotonic()
        timings = dict(data.get("timings") or {})
        n0, ms0 = self.own_prefill.get(slot, (0, 0.0))
        self.own_prefill[slot] = (n0 + int(timings.get("prompt_n") or 0), ms0 + float(timings.get("prompt_ms") or 0.0))
        timings["predicted_cache_n"] = pred.cache_n
        cached = data.get("tokens_cached")
        if cached is not None and int(cached) != len(tokens):
            log.warning("warm slot %d: server holds %s tokens, expected %d", slot, cached, len(tokens))
            st.n_total = int(cached)
        return timings
