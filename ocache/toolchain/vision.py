"""Generate a tiny random-weight vision projector (``--mmproj``) that the pinned ``mtmd`` loads, for
the image-prompt tests (``tests/test_images.py``, ``tests/test_image_tiers.py``; the text models are ``ocache/toolchain/models.py``).

The projector is LLaVA-shaped (``clip.projector_type`` ``mlp``: tools/mtmd/models/llava.cpp of the
pinned source): a ViT of ``VisionSpec.n_layer`` blocks over ``patch_size`` pixel patches of an
``image_size`` square, then a two-layer GELU MLP into the text model's embedding (``mm.0``,
``mm.2``; ``clip_n_mmproj_embd`` reads ``mm.2.weight``'s output size, clip.cpp:5972, and mtmd
refuses a projector whose output is not the text model's ``n_embd``). No class embedding, so an
image is ``(image_size / patch_size) ** 2`` embeddings: 16 for the tiny spec. The graph runs the
blocks up to the last but one (llava.cpp:13-28), so ``n_layer`` 2 runs one block.

Tensor names and the hparams read are clip.cpp's ``load_hparams``/``load_tensors`` (clip.cpp:1300-1440,
2253-2370); ``ffn_down`` has the block width as its output, so it is not taken for a legacy swapped
file (clip.cpp:2337-2350). Weights: the same seeded, ``1/sqrt(fan_in)`` scheme as the text models,
all F32. The file goes to ``cache_root()/models/<key16>/mmproj-<name>.gguf`` (key: the spec and
``GENERATOR_VERSION``), written to a temporary file under a lock and renamed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ocache.paths import file_lock
from ocache.toolchain.models import _import_gguf, models_dir, write_tensors

#: Bump when the file written for the same spec changes.
GENERATOR_VERSION = 1


@dataclass(frozen=True)
class VisionSpec:
    """A projector's shape: ``n_embd``/``n_ff``/``n_head``/``n_layer`` of the ViT, ``image_size``
    and ``patch_size`` in pixels, ``n_hidden`` the MLP's hidden width, ``n_embd_text`` the text
    model's embedding width (``models.PRESETS[...].n_embd``), ``seed`` of the weights."""

    n_embd: int = 32
    n_ff: int = 64
    n_head: int = 2
    n_layer: int = 2
    image_size: int = 32
    patch_size: int = 8
    n_hidden: int = 64
    n_embd_text: int = 64
    seed: int = 31

    @property
    def n_patches(self) -> int:
        """Embeddings (prompt positions) one image takes."""
        return (self.image_size // self.patch_size) ** 2


TINY = VisionSpec()


def _rand(spec: VisionSpec, name: str, shape: tuple[int, ...], fan_in: int) -> np.ndarray:
    digest = hashlib.sha256(f"{spec.seed}:{name}".encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    return (rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(fan_in))).astype(np.float32)


def _tensors(spec: VisionSpec):
    """(name, array) of every tensor, numpy shapes (ggml's reversed)."""
    E, P = spec.n_embd, spec.patch_size
    yield "v.patch_embd.weight", _rand(spec, "patch", (E, 3, P, P), 3 * P * P)
    yield "v.patch_embd.bias", np.zeros(E, dtype=np.float32)
    yield "v.position_embd.weight", _rand(spec, "pos", (spec.n_patches, E), E)
    for il in range(spec.n_layer):
        b = f"v.blk.{il}"
        for part in ("attn_q", "attn_k", "attn_v", "attn_out"):
            yield f"{b}.{part}.weight", _rand(spec, f"{b}.{part}", (E, E), E)
            yield f"{b}.{part}.bias", np.zeros(E, dtype=np.float32)
        for ln in ("ln1", "ln2"):
            yield f"{b}.{ln}.weight", np.ones(E, dtype=np.float32)
            yield f"{b}.{ln}.bias", np.zeros(E, dtype=np.float32)
        yield f"{b}.ffn_up.weight", _rand(spec, f"{b}.up", (spec.n_ff, E), E)
        yield f"{b}.ffn_up.bias", np.zeros(spec.n_ff, dtype=np.float32)
        yield f"{b}.ffn_down.weight", _rand(spec, f"{b}.down", (E, spec.n_ff), spec.n_ff)
        yield f"{b}.ffn_down.bias", np.zeros(E, dtype=np.float32)
    yield "mm.0.weight", _rand(spec, "mm0", (spec.n_hidden, E), E)
    yield "mm.0.bias", np.zeros(spec.n_hidden, dtype=np.float32)
    yield "mm.2.weight", _rand(spec, "mm2", (spec.n_embd_text, spec.n_hidden), spec.n_hidden)
    yield "mm.2.bias", np.zeros(spec.n_embd_text, dtype=np.float32)


def _write(spec: VisionSpec, dest: Path) -> None:
    gguf = _import_gguf()
    w = gguf.GGUFWriter(str(dest), "clip")
    try:
        w.add_string("general.name", "ocache-tiny-mmproj")
        w.add_string("clip.projector_type", "mlp")
        w.add_bool("clip.has_vision_encoder", True)
        w.add_bool("clip.use_gelu", True)
        w.add_uint32("clip.vision.embedding_length", spec.n_embd)
        w.add_uint32("clip.vision.feed_forward_length", spec.n_ff)
        w.add_uint32("clip.vision.block_count", spec.n_layer)
        w.add_uint32("clip.vision.projection_dim", spec.n_embd_text)
        w.add_uint32("clip.vision.attention.head_count", spec.n_head)
        w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
        w.add_uint32("clip.vision.image_size", spec.image_size)
        w.add_uint32("clip.vision.patch_size", spec.patch_size)
        w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
        w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
        w.add_uint32("general.file_type", 0)   # ALL_F32
        write_tensors(w, _tensors(spec))
    finally:
        w.close()


def make_projector(spec: VisionSpec = TINY) -> Path:
    """The projector GGUF of ``spec``: generated on first use (well under a second), then found."""
    key = hashlib.sha256(json.dumps({"spec": asdict(spec), "generator": GENERATOR_VERSION,
                                     "numpy": np.__version__}, sort_keys=True).encode()).hexdigest()[:16]
    folder = models_dir() / key
    dest = folder / "mmproj-tiny.gguf"
    if dest.exists():
        return dest
    folder.mkdir(parents=True, exist_ok=True)
    with file_lock(folder / ".lock"):
        if dest.exists():
            return dest
        tmp = folder / f".{dest.name}.{os.getpid()}.tmp"
        try:
            _write(spec, tmp)
            os.replace(tmp, dest)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
    return dest
