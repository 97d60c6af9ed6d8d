"""Generate the small random-weight GGUF models ocache is tested and benchmarked on.

Two models per preset, both loadable by the pinned llama-server:

* ``dense``: arch ``qwen3`` (every layer full attention, GQA, Q/K RMS norms).
* ``hybrid``: arch ``qwen35``, the shape of the Qwen3.5 family: gated-delta-net (linear attention,
  recurrent state) layers with a full-attention layer every 4th layer
  (``{arch}.full_attention_interval``; ``src/models/qwen35.cpp`` ``load_arch_hparams``).

Both carry the real Qwen tokenizer (every ``tokenizer.*`` field of ``models/ggml-vocab-qwen35.gguf``
in the pinned sdist, 151,936 tokens) and ocache's own tool-capable chat template
(``ocache/data/chat_template.jinja``, embedded as ``tokenizer.chat_template``), so real client
requests render and tokenize to realistic lengths.

Weights are random (a fixed seed per tensor, so a given spec gives byte-identical files). Each
matrix is drawn with stdev ``1/sqrt(fan_in)``: with one small stdev everywhere the residual stream
is dominated by the current token's embedding and greedy decoding just repeats the last token,
so output would not depend on the context and a broken cache would look like a working one
(``docs/decisions.md`` D4). The token embedding is tied to
the output (no ``output.weight``) and kept small (stdev ``EMBD_STD``) so the layers' outputs, which
depend on the whole prompt, dominate the logits; the Q/K norm weights (``ModelSpec.qk_norm``) make
attention peaked, so a change in the first tokens of a 7k-token prompt still changes the greedy
continuation (``tests/test_models.py::test_greedy_output_depends_on_early_context``).

Tensor shapes follow the loaders: ``src/models/qwen3.cpp`` and ``src/models/qwen35.cpp``
(``load_arch_tensors``). Traps (found while writing this generator; each file is loaded by a test): a delta-net layer without ``attn_qkv``/``attn_gate``
segfaults at load (the loader marks them optional), ``ssm.inner_size`` must equal
``ssm.state_size * ssm.time_step_rank`` (``head_v_dim = d_inner / num_v_heads`` in the graph vs
``ssm_d_state`` in the loader) and ``ssm_conv1d`` must be F32 (F16 aborts in ``ggml_ssm_conv``).
Matrices are F16, vectors and ``ssm_conv1d`` F32.

**Template families** (``make_family``, ``ocache models make --preset families``): one tiny dense
model per vocabulary of the pinned source's ``models/ggml-vocab-<name>.gguf`` (``FAMILY_VOCABS``:
Llama 3's, Gemma 4's, Phi-3's, ...), so each family's chat template (``models/templates/``) renders
and tokenizes on its own vocabulary; ``harmony`` is the Qwen vocabulary plus gpt-oss's special
tokens (``HARMONY_TOKENS``), appended as control tokens (one id each, type 3), since the pinned
source ships no o200k vocabulary. llama-vocab.cpp marks ``<|return|>``/``<|call|>``/``<|end|>``
end-of-generation by their text and then takes ``<|end|>`` out again when the other two are there
(``src/llama-vocab.cpp:2960-3003``), as on a real gpt-oss GGUF: a generation goes on through
``<|end|>`` between the analysis and the final channel.

Files go to ``cache_root()/models/<key16>/<preset>-<kind>-<arch>.gguf`` beside a ``model.json``
(spec, sha256, size, generation seconds), never into the checkout, where
``key16`` hashes the spec, ``GENERATOR_VERSION``, the vocab file's sha256, the template's bytes
and the numpy version (its random streams are only promised stable within a version). Generation
writes a temporary file and renames it, under a file lock, so concurrent test sessions neither
collide nor see half-written files; a second call finds the file and returns at once. The vocab's
tokenizer fields are extracted once into ``cache_root()/models/tokenizer-<sha16>.json`` (gguf-py's
reader needs ~10-20 s for the 300k strings; the JSON loads in a fraction of a second).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from ocache.paths import cache_root, file_lock, sha256_file

#: Bump when the generator's output changes for the same spec (it is part of every model key).
#: 2: F32 matrices and ``logit_scale`` (robust greedy choice, see ``ModelSpec``).
GENERATOR_VERSION = 2

#: Stdev of the (tied) token embedding; small, see the module docstring.
EMBD_STD = 0.02

KINDS = ("dense", "hybrid")


@dataclass(frozen=True)
class ModelSpec:
    """Hyper-parameters of one generated model (sizes in elements; ``n_ctx_train`` in tokens).

    ``n_head``/``n_head_kv``/``head_dim`` describe the full-attention layers. For ``qwen35`` the
    ``ssm_*`` fields describe the gated-delta-net layers: ``ssm_state`` is the key/value head
    width, ``ssm_groups`` the number of key heads, ``ssm_v_heads`` the number of value heads
    (``ssm.time_step_rank``); the inner size is ``ssm_state * ssm_v_heads``. ``rope_dims`` is the
    rotated part of a head (qwen3 requires the whole head), ``rope_sections`` the IMROPE sections
    (t, h, w, e) of qwen35, summing to ``rope_dims / 2``. ``qk_norm`` is the value of every
    Q/K RMS-norm weight: it scales the attention logits by ``qk_norm**2`` (the norms make q and k
    unit-RMS), so attention is peaked rather than a near-uniform average in which one early token
    weighs 1/n. Measured on the tiny models (4 prompt pairs differing in their first words, 16
    greedy tokens): with 1.0 the dense model ignored the change in 1 of 4 pairs at 3k and 8k tokens
    and a 4-layer hybrid (one attention layer) in 4 of 4 at 3k; with 3.0, dense 2 layers and hybrid
    6+2 layers diverged in 4 of 4 pairs at 600, 3k and 7k tokens.

    ``weight_type`` and ``logit_scale`` make the greedy choice robust to *batching noise* (the
    server's arithmetic differs slightly with the ubatch split and with the sequences batched
    together; ``ocache/bench/exact.py``). ``logit_scale`` is the final RMS-norm weight: with the small
    tied embedding the logits of generator version 1 spanned ~0.16 nats over 151k tokens (top-1
    log-probability -11.2, median top-1 margin 0.025 nats), so noise flipped the argmax (1 answer
    in 8 under batching); scaled by 25 they are peaked (top-1 log-probability ~ -2, median margin
    0.5-0.6 nats). F32 matrices remove the F16 rounding of activations in the CPU matmuls
    (``ggml-cpu`` converts ``src1`` to the weight's vec-dot type): at the same scale the median
    batching noise fell 20x (2.2e-3 -> 1.0e-4 nats, hybrid). Measured by
    ``tests/test_models.py::test_batching_noise_is_far_below_the_margin`` (run with ``-s``).
    F32 doubles the files (tiny: 26 -> 46 MB).
    """

    arch: str
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rope_dims: int
    rope_freq_base: float
    n_ctx_train: int = 131072
    rms_eps: float = 1e-6
    full_attention_interval: int = 4
    rope_sections: tuple[int, int, int, int] = (0, 0, 0, 0)
    ssm_conv: int = 4
    ssm_state: int = 0
    ssm_groups: int = 0
    ssm_v_heads: int = 0
    qk_norm: float = 3.0
    weight_type: str = "f32"
    logit_scale: float = 25.0
    seed: int = 1234

    @property
    def ssm_inner(self) -> int:
        return self.ssm_state * self.ssm_v_heads

    def validate(self) -> None:
        """Raise ValueError for a spec the pinned loader would reject or crash on."""
        if self.weight_type not in ("f32", "f16"):
            raise ValueError(f"weight_type {self.weight_type!r}: f32 or f16")
        if self.arch not in ("qwen3", "qwen35"):
            raise ValueError(f"unsupported arch {self.arch!r} (qwen3 or qwen35)")
        if self.n_head % self.n_head_kv:
            raise ValueError("n_head must be a multiple of n_head_kv")
        if self.arch == "qwen3" and self.rope_dims != self.head_dim:
            raise ValueError("qwen3 rotates the whole head: rope_dims must equal head_dim")
        if self.arch == "qwen35":
            if self.n_layer % self.full_attention_interval:
                raise ValueError("n_layer must be a multiple of full_attention_interval")
            if min(self.ssm_state, self.ssm_groups, self.ssm_v_heads) <= 0:
                raise ValueError("qwen35 needs ssm_state, ssm_groups and ssm_v_heads")
            if self.ssm_v_heads % self.ssm_groups:
                raise ValueError("ssm_v_heads must be a multiple of ssm_groups")
            if sum(self.rope_sections) * 2 != self.rope_dims or self.rope_dims > self.head_dim:
                raise ValueError("rope_sections must sum to rope_dims/2 <= head_dim/2")

    def is_recurrent(self, il: int) -> bool:
        """Whether layer ``il`` is a gated-delta-net layer (qwen35.cpp: (il+1) % interval != 0)."""
        return self.arch == "qwen35" and (il + 1) % self.full_attention_interval != 0


#: The presets. ``tiny``: fast tests (loads in well under a second, prefills thousands of tokens a
#: second on one thread). ``bench``: a 16k-token prefill takes tens of seconds on 2 cores, so
#: cache effects are visible (n_embd 1024, 8 layers,
#: 2 KV heads of 128, hybrid = 6 delta-net + 2 attention layers).
PRESETS: dict[str, dict[str, ModelSpec]] = {
    "tiny": {
        "dense": ModelSpec(arch="qwen3", n_embd=64, n_layer=2, n_ff=192, n_head=4, n_head_kv=2,
                           head_dim=32, rope_dims=32, rope_freq_base=1e6),
        "hybrid": ModelSpec(arch="qwen35", n_embd=64, n_layer=8, n_ff=192, n_head=4, n_head_kv=2,
                            head_dim=32, rope_dims=16, rope_sections=(3, 3, 2, 0),
                            rope_freq_base=1e7, ssm_state=16, ssm_groups=2, ssm_v_heads=4),
    },
    "bench": {
        "dense": ModelSpec(arch="qwen3", n_embd=1024, n_layer=8, n_ff=3072, n_head=8,
                           n_head_kv=2, head_dim=128, rope_dims=128, rope_freq_base=1e6),
        "hybrid": ModelSpec(arch="qwen35", n_embd=1024, n_layer=8, n_ff=3072, n_head=8,
                            n_head_kv=2, head_dim=128, rope_dims=64, rope_sections=(11, 11, 10, 0),
                            rope_freq_base=1e7, ssm_state=128, ssm_groups=8, ssm_v_heads=8),
    },
}


class ModelError(RuntimeError):
    """A model could not be generated (bad preset, missing vocab, write failure)."""


def _log(msg: str) -> None:
    print(f"[ocache models] {msg}", file=sys.stderr, flush=True)


def template_path() -> Path:
    """The shipped chat template (``--chat-template-file`` accepts it; also embedded in the models)."""
    return Path(__file__).resolve().parent.parent / "data" / "chat_template.jinja"


def models_dir() -> Path:
    path = cache_root() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path




def _import_gguf():
    """The ``gguf`` package of the pinned llama.cpp source (it knows the ``qwen35`` arch)."""
    from ocache.toolchain import engine

    gdir = str(engine.gguf_py_dir())
    if gdir not in sys.path:
        sys.path.insert(0, gdir)
    import gguf  # noqa: PLC0415  (path set just above)

    if not hasattr(gguf.MODEL_ARCH, "QWEN35"):
        raise ModelError(f"the gguf package imported from {gguf.__file__} does not know qwen35; "
                         f"expected the pinned one in {gdir}")
    return gguf


def _vocab_path() -> Path:
    from ocache.toolchain import engine

    path = engine.vocab_gguf()
    if not path.exists():
        raise ModelError(f"tokenizer vocabulary {path} not found in the pinned source")
    return path


def model_key(spec: ModelSpec, vocab_sha256: str, template_bytes: bytes,
              extra_tokens: tuple[str, ...] = (), family: str = "") -> str:
    """16 hex digits identifying the file this generator writes for ``spec`` (``extra_tokens``:
    control tokens appended to the vocabulary; ``family``: a family model's name, its own folder
    and ``model.json``; each in the key only when set, so the keys of the presets' models are
    unchanged)."""
    h = hashlib.sha256()
    fields: dict = {
        "spec": asdict(spec), "generator": GENERATOR_VERSION, "vocab": vocab_sha256,
        "template": hashlib.sha256(template_bytes).hexdigest(), "numpy": np.__version__,
        "embd_std": EMBD_STD,
    }
    if extra_tokens:
        fields["extra_tokens"] = list(extra_tokens)
    if family:
        fields["family"] = family
    h.update(json.dumps(fields, sort_keys=True).encode())
    return h.hexdigest()[:16]


def _rng(spec: ModelSpec, name: str) -> np.random.Generator:
    """One independent stream per tensor (seeded by spec.seed and the tensor name)."""
    digest = hashlib.sha256(f"{spec.seed}:{name}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def _matrix(spec: ModelSpec, name: str, n_out: int, n_in: int, std: float | None = None,
            dtype=None) -> np.ndarray:
    """A weight of ggml shape {n_in, n_out} (numpy (n_out, n_in)), stdev 1/sqrt(n_in) by default,
    stored as ``spec.weight_type`` unless ``dtype`` says otherwise."""
    std = (1.0 / np.sqrt(n_in)) if std is None else std
    if dtype is None:
        dtype = np.float32 if spec.weight_type == "f32" else np.float16
    x = _rng(spec, name).standard_normal((n_out, n_in), dtype=np.float32)
    x *= np.float32(std)
    return x.astype(dtype)


def _ones(n: int) -> np.ndarray:
    return np.ones(n, dtype=np.float32)


def _tensors(spec: ModelSpec, n_vocab: int):
    """Yield (name, array) for every tensor the loader of ``spec.arch`` reads, in file order."""
    E = spec.n_embd
    yield "token_embd.weight", _matrix(spec, "token_embd", n_vocab, E, std=EMBD_STD)
    yield "output_norm.weight", _ones(E) * np.float32(spec.logit_scale)
    q_out = spec.n_head * spec.head_dim
    kv_out = spec.n_head_kv * spec.head_dim
    for il in range(spec.n_layer):
        p = f"blk.{il}."
        yield p + "attn_norm.weight", _ones(E)
        if spec.arch == "qwen3":
            yield p + "attn_q.weight", _matrix(spec, p + "attn_q", q_out, E)
            yield p + "attn_k.weight", _matrix(spec, p + "attn_k", kv_out, E)
            yield p + "attn_v.weight", _matrix(spec, p + "attn_v", kv_out, E)
            yield p + "attn_output.weight", _matrix(spec, p + "attn_output", E, q_out)
            yield p + "attn_q_norm.weight", _ones(spec.head_dim) * np.float32(spec.qk_norm)
            yield p + "attn_k_norm.weight", _ones(spec.head_dim) * np.float32(spec.qk_norm)
            yield p + "ffn_norm.weight", _ones(E)
        elif not spec.is_recurrent(il):
            # qwen35 full attention: Q projects to query + output gate (2 * n_head * head_dim)
            yield p + "post_attention_norm.weight", _ones(E)
            yield p + "attn_q.weight", _matrix(spec, p + "attn_q", 2 * q_out, E)
            yield p + "attn_k.weight", _matrix(spec, p + "attn_k", kv_out, E)
            yield p + "attn_v.weight", _matrix(spec, p + "attn_v", kv_out, E)
            yield p + "attn_output.weight", _matrix(spec, p + "attn_output", E, q_out)
            yield p + "attn_q_norm.weight", _ones(spec.head_dim) * np.float32(spec.qk_norm)
            yield p + "attn_k_norm.weight", _ones(spec.head_dim) * np.float32(spec.qk_norm)
        else:
            # gated delta net (qwen35.cpp load_block_trunk / build_layer_attn_linear)
            key_dim = spec.ssm_state * spec.ssm_groups
            value_dim = spec.ssm_state * spec.ssm_v_heads
            conv_dim = 2 * key_dim + value_dim
            H = spec.ssm_v_heads
            yield p + "post_attention_norm.weight", _ones(E)
            yield p + "attn_qkv.weight", _matrix(spec, p + "attn_qkv", conv_dim, E)
            yield p + "attn_gate.weight", _matrix(spec, p + "attn_gate", value_dim, E)
            yield p + "ssm_conv1d.weight", _matrix(spec, p + "ssm_conv1d", conv_dim, spec.ssm_conv,
                                                   dtype=np.float32)
            # per-head decay: gate = softplus(alpha + dt_bias) * ssm_a, ssm_a = -A < 0; A log-uniform
            # in [1e-3, 1e-1] gives memories from ~10 to ~1000 tokens, so early context matters
            r = _rng(spec, p + "ssm_a")
            yield p + "ssm_a", (-np.exp(r.uniform(np.log(1e-3), np.log(1e-1), H))).astype(np.float32)
            yield p + "ssm_dt.bias", np.zeros(H, dtype=np.float32)
            yield p + "ssm_beta.weight", _matrix(spec, p + "ssm_beta", H, E)
            yield p + "ssm_alpha.weight", _matrix(spec, p + "ssm_alpha", H, E)
            yield p + "ssm_norm.weight", _ones(spec.ssm_state)
            yield p + "ssm_out.weight", _matrix(spec, p + "ssm_out", E, value_dim)
        yield p + "ffn_gate.weight", _matrix(spec, p + "ffn_gate", spec.n_ff, E)
        yield p + "ffn_up.weight", _matrix(spec, p + "ffn_up", spec.n_ff, E)
        yield p + "ffn_down.weight", _matrix(spec, p + "ffn_down", E, spec.n_ff)


def _tokenizer_fields(vocab: Path, vocab_sha256: str) -> list[tuple[str, int, int | None, object]]:
    """Every ``tokenizer.*`` KV field of the vocab file as (key, type, array sub-type, value).

    ``GGUFReader`` takes ~10-20 s on this 300k-string file, so the fields are extracted once and
    kept as JSON beside the models (``tokenizer-<sha16>.json``, written atomically).
    """
    cache = models_dir() / f"tokenizer-{vocab_sha256[:16]}.json"
    if cache.exists():
        return [tuple(f) for f in json.loads(cache.read_text(encoding="utf-8"))]
    gguf = _import_gguf()
    reader = gguf.GGUFReader(vocab)
    fields = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer.") or key == "tokenizer.chat_template":
            continue
        vtype = int(field.types[0])
        sub = int(field.types[-1]) if field.types[0] == gguf.GGUFValueType.ARRAY else None
        val = field.contents()
        fields.append((key, vtype, sub, val))
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(fields, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, cache)
    return fields


#: ``tokenizer.ggml.token_type`` of a control token (gguf-py ``TokenType.CONTROL``)
CONTROL = 3


def _copy_tokenizer(gguf, writer, vocab: Path, vocab_sha256: str, extra_tokens: tuple[str, ...] = ()) -> int:
    """Copy every ``tokenizer.*`` KV field of the vocab file, ``extra_tokens`` appended to its
    tokens as control tokens (a score of 0 where the vocab has scores); return the vocabulary size."""
    n_vocab = 0
    keys = set()
    fields = _tokenizer_fields(vocab, vocab_sha256)
    names: dict[str, Any] = {key: val for key, _, _, val in fields}
    if extra_tokens:
        clash = set(extra_tokens) & set(names.get("tokenizer.ggml.tokens") or ())
        if clash:
            raise ModelError(f"{vocab} already has the tokens {sorted(clash)}")
    for key, vtype, sub, value in fields:
        keys.add(key)
        val: Any = value
        if extra_tokens and key == "tokenizer.ggml.tokens":
            val = list(val) + list(extra_tokens)
        elif extra_tokens and key == "tokenizer.ggml.token_type":
            val = list(val) + [CONTROL] * len(extra_tokens)
        elif extra_tokens and key == "tokenizer.ggml.scores":
            val = list(val) + [0.0] * len(extra_tokens)
        writer.add_key_value(key, val, gguf.GGUFValueType(vtype),
                             sub_type=None if sub is None else gguf.GGUFValueType(sub))
        if key == "tokenizer.ggml.tokens":
            n_vocab = len(val)
    if not n_vocab:
        raise ModelError(f"{vocab} has no tokenizer.ggml.tokens")
    if "tokenizer.ggml.add_bos_token" not in keys and names.get("tokenizer.ggml.pre") in ("qwen2", "qwen35"):
        # Qwen adds no BOS; llama-vocab.cpp defaults to false for this pre-tokenizer, say it anyway
        writer.add_bool("tokenizer.ggml.add_bos_token", False)
    return n_vocab


def _write(spec: ModelSpec, dest: Path, name: str, vocab: Path, vocab_sha256: str,
           template: str, extra_tokens: tuple[str, ...] = ()) -> None:
    """Write the GGUF for ``spec`` to ``dest`` (not atomic: ``make_one`` writes a temp file)."""
    gguf = _import_gguf()
    import logging

    logging.getLogger("gguf").setLevel(logging.WARNING)
    writer = gguf.GGUFWriter(str(dest), spec.arch)
    try:
        writer.add_name(name)
        writer.add_context_length(spec.n_ctx_train)
        writer.add_embedding_length(spec.n_embd)
        writer.add_block_count(spec.n_layer)
        writer.add_feed_forward_length(spec.n_ff)
        writer.add_head_count(spec.n_head)
        writer.add_head_count_kv(spec.n_head_kv)
        writer.add_key_length(spec.head_dim)
        writer.add_value_length(spec.head_dim)
        writer.add_rope_dimension_count(spec.rope_dims)
        writer.add_rope_freq_base(spec.rope_freq_base)
        writer.add_layer_norm_rms_eps(spec.rms_eps)
        if spec.arch == "qwen35":
            writer.add_full_attention_interval(spec.full_attention_interval)
            writer.add_rope_dimension_sections(list(spec.rope_sections))
            writer.add_ssm_conv_kernel(spec.ssm_conv)
            writer.add_ssm_inner_size(spec.ssm_inner)
            writer.add_ssm_state_size(spec.ssm_state)
            writer.add_ssm_time_step_rank(spec.ssm_v_heads)
            writer.add_ssm_group_count(spec.ssm_groups)
        writer.add_file_type(gguf.LlamaFileType.ALL_F32 if spec.weight_type == "f32"
                             else gguf.LlamaFileType.MOSTLY_F16)
        n_vocab = _copy_tokenizer(gguf, writer, vocab, vocab_sha256, extra_tokens)
        writer.add_chat_template(template)
        write_tensors(writer, _tensors(spec, n_vocab))
    finally:
        writer.close()


def write_tensors(writer: Any, tensors: Iterable[tuple[str, np.ndarray]]) -> None:
    """Add ``tensors`` ((name, array) pairs) to a ``gguf.GGUFWriter`` whose keys are set, and write
    the file: header, keys, tensors."""
    for name, arr in tensors:
        writer.add_tensor(name, arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)




def _spec(preset: str, kind: str) -> ModelSpec:
    try:
        spec = PRESETS[preset][kind]
    except KeyError:
        raise ModelError(f"unknown model {preset}/{kind}; presets {sorted(PRESETS)}, "
                         f"kinds {list(KINDS)}") from None
    spec.validate()
    return spec


def model_path(preset: str, kind: str) -> Path:
    """Where ``make`` puts (or has put) this model; it may not exist yet. Raises ModelError."""
    spec = _spec(preset, kind)
    vocab = _vocab_path()
    key = model_key(spec, _vocab_sha256(vocab), template_path().read_bytes())
    return models_dir() / key / f"{preset}-{kind}-{spec.arch}.gguf"


def make_one(preset: str, kind: str) -> Path:
    """Generate (or find) one model; return its path. Raises ModelError for an unknown preset/kind."""
    return _make(_spec(preset, kind), preset, kind, _vocab_path())


def _make(spec: ModelSpec, preset: str, kind: str, vocab: Path, extra_tokens: tuple[str, ...] = ()) -> Path:
    """Generate (or find) ``spec`` with the tokenizer of ``vocab`` (plus ``extra_tokens``) as
    ``<preset>-<kind>-<arch>.gguf`` in its key's folder; return its path."""
    template = template_path().read_bytes()
    vocab_sha = _vocab_sha256(vocab)
    key = model_key(spec, vocab_sha, template, extra_tokens, family=kind if preset == "families" else "")
    folder = models_dir() / key
    dest = folder / f"{preset}-{kind}-{spec.arch}.gguf"
    if dest.exists():
        return dest
    folder.mkdir(parents=True, exist_ok=True)
    with file_lock(folder / ".lock"):
        if dest.exists():  # another process finished it while we waited
            return dest
        t0 = time.monotonic()
        tmp = folder / f".{dest.name}.{os.getpid()}.tmp"
        try:
            _write(spec, tmp, f"ocache-{preset}-{kind}", vocab, vocab_sha, template.decode("utf-8"),
                   extra_tokens)
            meta: dict[str, Any] = {"preset": preset, "kind": kind, "key": key, "spec": asdict(spec),
                    "generator": GENERATOR_VERSION, "vocab": str(vocab), "numpy": np.__version__,
                    "bytes": tmp.stat().st_size, "sha256": sha256_file(tmp),
                    "seconds": round(time.monotonic() - t0, 2)}
            if extra_tokens:
                meta["extra_tokens"] = list(extra_tokens)
            (folder / "model.json").write_text(json.dumps(meta, indent=1))
            os.replace(tmp, dest)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        _log(f"generated {dest} ({meta['bytes'] / 1e6:.1f} MB) in {meta['seconds']} s")
    return dest


# ------------------------------------------------------------------------------ template families

#: gpt-oss's special tokens (the harmony format: ``models/templates/openai-gpt-oss-120b.jinja`` of
#: the pinned source writes every one but ``<|startoftext|>``); the Qwen vocabulary has none of them
HARMONY_TOKENS: tuple[str, ...] = ("<|startoftext|>", "<|return|>", "<|constrain|>", "<|channel|>",
                                   "<|start|>", "<|end|>", "<|message|>", "<|call|>")


@dataclass(frozen=True)
class FamilyVocab:
    """A family model's tokenizer: ``vocab``, the pinned source's ``models/ggml-vocab-<vocab>.gguf``,
    with ``extra`` control tokens appended (one id each)."""

    vocab: str
    extra: tuple[str, ...] = ()


#: the vocabularies of the template families (``make_family``); keys name the models
FAMILY_VOCABS: dict[str, FamilyVocab] = {
    "qwen35": FamilyVocab("qwen35"),          # Qwen3.5
    "qwen2": FamilyVocab("qwen2"),            # Qwen2.5, Qwen3, QwQ, DeepSeek-R1-Distill-Qwen
    "llama-bpe": FamilyVocab("llama-bpe"),    # Llama 3.x, DeepSeek-R1-Distill-Llama
    "gemma-4": FamilyVocab("gemma-4"),        # Gemma 4
    "phi-3": FamilyVocab("phi-3"),            # Phi-3, Phi-3.5
    "command-r": FamilyVocab("command-r"),    # Command R, R7B
    "harmony": FamilyVocab("qwen35", HARMONY_TOKENS),   # gpt-oss: no o200k vocab in the source
}

#: the spec of every family model: the ``tiny`` dense one (only the vocabulary differs)
FAMILY_SPEC = PRESETS["tiny"]["dense"]


def family_vocab_path(name: str) -> Path:
    """``models/ggml-vocab-<vocab>.gguf`` of the pinned source for family model ``name``."""
    from ocache.toolchain import engine

    try:
        fam = FAMILY_VOCABS[name]
    except KeyError:
        raise ModelError(f"unknown family vocabulary {name!r}; one of {sorted(FAMILY_VOCABS)}") from None
    path = engine.source_dir() / "models" / f"ggml-vocab-{fam.vocab}.gguf"
    if not path.exists():
        raise ModelError(f"tokenizer vocabulary {path} not found in the pinned source")
    return path


def make_family(name: str) -> Path:
    """Generate (or find) the tiny dense model with family ``name``'s vocabulary
    (``FAMILY_VOCABS``); ``families-<name>-qwen3.gguf``. Raises ModelError for an unknown name or
    a vocab the source lacks."""
    path = family_vocab_path(name)
    FAMILY_SPEC.validate()
    return _make(FAMILY_SPEC, "families", name, path, FAMILY_VOCABS[name].extra)


#: the fill-in-the-middle tokens of Qwen2.5-Coder and Qwen3-Coder; llama-vocab.cpp finds them by
#: their text (src/llama-vocab.cpp, "find FIM_PRE token"). The presets' vocabulary has none, so
#: llama-server answers ``/infill`` with 501 on the tiny models
FIM_TOKENS: tuple[str, ...] = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


def make_fim() -> Path:
    """Generate (or find) the tiny dense model with ``FIM_TOKENS`` appended as control tokens, on
    which llama-server serves ``/infill``: ``families-fim-qwen3.gguf``."""
    FAMILY_SPEC.validate()
    return _make(FAMILY_SPEC, "families", "fim", _vocab_path(), FIM_TOKENS)


def make_families() -> dict[str, Path]:
    """``{name: path}`` of every family model (the first call reads each vocab once: ~5-20 s each
    on 2 cores, then cached as ``tokenizer-<sha16>.json``)."""
    return {name: make_family(name) for name in FAMILY_VOCABS}


def write_reseeded(preset: str, kind: str, dest: Path, seed: int) -> Path:
    """Write to ``dest`` the preset's model with other weights: the same spec under another
    ``seed``, the same name, vocab and template. The seed is not in the metadata, so the file's
    header (every key/value and tensor info) and its size equal ``make_one(preset, kind)``'s and
    only the tensor data differs: a model "replaced with an equal header and size" (``scripts/faults``). Not cached. Raises ModelError for an unknown preset/kind."""
    from dataclasses import replace

    spec = replace(_spec(preset, kind), seed=seed)
    vocab = _vocab_path()
    _write(spec, dest, f"ocache-{preset}-{kind}", vocab, _vocab_sha256(vocab),
           template_path().read_bytes().decode("utf-8"))
    return dest


_VOCAB_SHA: dict[tuple[str, int, int], str] = {}


def _vocab_sha256(vocab: Path) -> str:
    """sha256 of the vocab file, memoised by (path, size, mtime) within this process."""
    st = vocab.stat()
    k = (str(vocab), st.st_size, st.st_mtime_ns)
    if k not in _VOCAB_SHA:
        _VOCAB_SHA[k] = sha256_file(vocab)
    return _VOCAB_SHA[k]


def make(preset: str = "tiny") -> dict[str, Path]:
    """Return ``{"dense": Path, "hybrid": Path}`` for ``preset`` ("tiny" or "bench").

    Generates the files on first use (tiny: about a second each; bench: several seconds and
    ~0.5 GB each), then returns at once. Raises ModelError for an unknown preset.
    """
    if preset not in PRESETS:
        raise ModelError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    return {kind: make_one(preset, kind) for kind in KINDS}


# ----------------------------------------------------------------------------------------- CLI

def _cmd_make(args) -> int:
    if args.preset == "families":
        for name, path in make_families().items():
            print(f"families\t{name}\t{path}")
        return 0
    presets = sorted(PRESETS) if args.preset == "all" else [args.preset]
    for preset in presets:
        for kind, path in make(preset).items():
            print(f"{preset}\t{kind}\t{path}")
    # the template is in each GGUF (tokenizer.chat_template): a path printed bare read as one to pass
    print(f"template\t{template_path()}\t(already embedded in each model above: llama-server --jinja "
          "uses it, nothing to pass)")
    return 0


def _cmd_path(args) -> int:
    if args.template:
        print(template_path())
    elif args.kind:
        path = model_path(args.preset, args.kind)
        if not path.exists():
            print(f"{path} is not generated yet: run `ocache models make --preset {args.preset}`",
                  file=sys.stderr)
            return 1
        print(path)
    else:
        print(models_dir())
    return 0


def register(subparsers) -> None:
    """Add ``ocache models make [--preset tiny|bench|all]`` and ``ocache models path``."""
    p = subparsers.add_parser("models", help="generate the small test/benchmark GGUF models")
    sub = p.add_subparsers(dest="models_command", metavar="ACTION")
    pm = sub.add_parser("make", help="generate (or find cached) models and print their paths")
    pm.add_argument("--preset", choices=[*sorted(PRESETS), "all", "families"], default="tiny",
                    help="families: one tiny dense model per template family's vocabulary")
    pm.set_defaults(func=_cmd_make)
    pp = sub.add_parser("path", help="print the models cache folder, one model's path (--kind) "
                                     "or the chat template's (--template)")
    pp.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    pp.add_argument("--kind", choices=KINDS, help="print this model's path (exit 1 if not made)")
    pp.add_argument("--template", action="store_true", help="print the chat template's path")
    pp.set_defaults(func=_cmd_path)
    p.set_defaults(func=lambda args: (p.print_help(), 0)[1])
