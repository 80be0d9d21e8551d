"""A tiny random-weight LLaVA-1.5 model built locally in seconds, and deterministic images.

No hub is needed (the demo and the end-to-end tests run offline), so the model is made here:
a byte-level BPE tokenizer trained on a few sentences, a CLIP vision tower and a 2-layer
Llama LM. The tests' default tower (``TINY_TOWER``: 2 layers, 64 wide, 56 px images, 14 px
patches, so 16 image tokens) costs next to nothing; the demo's (``DEMO_TOWER``) has LLaVA-1.5's
real image shape and a ViT-B-sized CLIP costing about 450 ms per image on 2 CPU cores, so
that the encoder cache has something to save. Only the seed changes the weights, so two seeds
give two genuinely different models. transformers, tokenizers, safetensors and Pillow come
with vLLM and are imported only when used.
"""

from __future__ import annotations

import base64
import io
import json
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # Pillow and transformers come with vLLM, not with ec_redis
    from PIL import Image
    from transformers import PreTrainedTokenizerFast

PATCH_SIZE = 14


@dataclass(frozen=True)
class VisionTower:
    """The CLIP vision tower's size: ``layers`` encoder layers ``width`` wide (their MLP
    ``mlp_ratio`` times as wide) on ``image_size`` px square images cut into 14 px patches,
    one image token per patch (the CLS position is dropped, "default")."""

    layers: int
    width: int
    image_size: int
    mlp_ratio: int = 4

    @property
    def num_image_tokens(self) -> int:
        return (self.image_size // PATCH_SIZE) ** 2

    @property
    def intermediate_size(self) -> int:
        return self.width * self.mlp_ratio

    @property
    def name_suffix(self) -> str:
        """What the tower adds to the model's directory name ("" for the tests' default)."""
        if self == TINY_TOWER:
            return ""
        return f"-v{self.layers}x{self.width}p{self.image_size}"

    def describe(self) -> str:
        return (
            f"{self.layers}-layer CLIP, {self.width} wide, on {self.image_size} px images "
            f"({self.num_image_tokens} tokens)"
        )


# The tests' tower: next to free, so that the end-to-end tests stay fast.
TINY_TOWER = VisionTower(layers=2, width=64, image_size=56, mlp_ratio=2)
# The demo's tower: LLaVA-1.5's real image shape (336 px / 14 px patches = 576 tokens) on a
# ViT-B/14-sized CLIP (12 layers 768 wide, 86M parameters), sized so that one image costs a
# few hundred ms on 2 CPU cores: vLLM's tower and projector, in an engine set up as the
# demo's (bf16, 2 threads), took 447 ms at best and 471 ms median over 20 images on an
# otherwise idle 2-core machine (transformers' CLIPVisionModel of that shape: 490-610 ms),
# and a second or more when the machine is busy. The LM stays tiny, so the tower is where a
# new image's time to first token goes, and the cache has something to save.
DEMO_TOWER = VisionTower(layers=12, width=768, image_size=336)
DEMO_TOWER_COST = "~450 ms per image on 2 CPU cores"
IMAGE_SIZE = TINY_TOWER.image_size
NUM_IMAGE_TOKENS = TINY_TOWER.num_image_tokens  # the tests' default model
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
IMAGE_TOKEN_ID = SPECIAL_TOKENS.index("<image>")
# Raw LLaVA-1.5 prompt; the saved chat template renders the same shape.
RAW_PROMPT = "USER: <image>\n{question} ASSISTANT:"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}USER: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<image>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %} "
    "{% else %}ASSISTANT: {{ message['content'] if message['content'] is string "
    "else message['content'][0]['text'] }}</s>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
_CORPUS = [
    "USER: What is shown in this image? ASSISTANT: A small picture of colored squares.",
    "USER: Describe the image in one word. ASSISTANT: Noise.",
    "The quick brown fox jumps over the lazy dog.",
    "Encoder outputs travel from the producer to the consumer through Redis.",
    "A cat, a dog and a bird sit on a red, green and blue fence.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9. Punctuation: , . ? ! : ; ' \" ( )",
]
_DONE_MARKER = ".tiny_llava_done"


def build_tiny_llava(
    path: Path,
    seed: int = 0,
    name_suffix: str = "",
    *,
    num_attention_heads: int = 2,
    num_key_value_heads: int = 1,
    vision_tower: VisionTower = TINY_TOWER,
) -> Path:
    """Build the model under ``path`` and return its directory.

    The directory is ``path / f"tiny-llava-s{seed}{name_suffix}"``; ``name_suffix`` lets a
    test hold two copies of the same weights under different model ids. A directory that
    was already built completely is reused as is; the build happens in a scratch directory
    renamed into place at the end, so a concurrent or interrupted build never leaves a
    half-written model under that name.

    ``num_attention_heads`` (vision tower and LM: the tower has that many heads per 64 of its
    width, the LM's heads are 64 wide) and ``num_key_value_heads`` (LM) shape the attention
    for tensor parallelism, where vLLM needs head counts divisible by the TP size. Other
    values than the defaults (2 and 1) add ``-h{heads}kv{kv_heads}`` to the directory name.

    ``vision_tower`` sizes the CLIP tower and the images (see ``make_image``); the default
    ``TINY_TOWER`` is the tests' model, ``DEMO_TOWER`` the demo's heavier one. Another tower
    than the default adds ``VisionTower.name_suffix`` (``-v{layers}x{width}p{image_size}``)
    to the directory name.

    Every file of the model is made readable by everyone (0644, directories 0755), whatever
    the umask and the libraries writing them chose.
    """
    shape = (num_attention_heads, num_key_value_heads)
    shape_suffix = "" if shape == (2, 1) else f"-h{shape[0]}kv{shape[1]}"
    dir_name = f"tiny-llava-s{seed}{name_suffix}{shape_suffix}{vision_tower.name_suffix}"
    model_dir = Path(path) / dir_name
    if (model_dir / _DONE_MARKER).exists():
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}-", dir=model_dir.parent))
    try:
        _build(scratch, seed, num_attention_heads, num_key_value_heads, vision_tower)
        done: dict[str, object] = {"seed": seed, "heads": shape}
        if vision_tower != TINY_TOWER:
            done["vision_tower"] = vision_tower.name_suffix
        (scratch / _DONE_MARKER).write_text(json.dumps(done))
        _make_readable(scratch)
        if not (model_dir / _DONE_MARKER).exists():
            shutil.rmtree(model_dir, ignore_errors=True)  # an incomplete build of long ago
            scratch.rename(model_dir)
    except OSError:
        if not (model_dir / _DONE_MARKER).exists():  # another process won the rename
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return model_dir


def _make_readable(model_dir: Path) -> None:
    """0755 for directories, 0644 for files: mkdtemp makes the directory 0700 and safetensors
    writes the weights 0600, which would hide the model from other users (a vLLM server
    running as another user, a container mounting the directory)."""
    model_dir.chmod(0o755)
    for entry in model_dir.rglob("*"):
        if entry.is_symlink():
            continue
        entry.chmod(0o755 if entry.is_dir() else 0o644)


def _build(model_dir: Path, seed: int, heads: int, kv_heads: int, tower: VisionTower) -> None:
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" for a small file

    tokenizer = _build_tokenizer()
    vision_config = CLIPVisionConfig(
        hidden_size=tower.width,
        intermediate_size=tower.intermediate_size,
        num_hidden_layers=tower.layers,
        num_attention_heads=heads * (tower.width // 64),
        image_size=tower.image_size,
        patch_size=PATCH_SIZE,
        projection_dim=64,
    )
    # Room for the image tokens, the question and the answer (512 for the tests' model).
    max_positions = max(512, 1 << (tower.num_image_tokens + 255).bit_length())
    text_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=64,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    config = LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=IMAGE_TOKEN_ID,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        image_seq_length=tower.num_image_tokens,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.bfloat16).eval()
    model.save_pretrained(model_dir)
    _fix_vision_tower_keys(model_dir / "model.safetensors")

    image_processor = CLIPImageProcessor(
        size={"shortest_edge": tower.image_size},
        crop_size={"height": tower.image_size, "width": tower.image_size},
        do_center_crop=True,
        do_convert_rgb=True,
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS position, dropped by "default"
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(model_dir)


def _build_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_CORPUS, trainer=trainer)
    assert bpe.token_to_id("<image>") == IMAGE_TOKEN_ID
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        extra_special_tokens={"image_token": "<image>"},
        add_bos_token=True,
        chat_template=CHAT_TEMPLATE,
    )


def _fix_vision_tower_keys(weights: Path) -> None:
    """transformers 5 saves ``vision_tower.*``; vLLM 0.32 loads ``vision_tower.vision_model.*``."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    renamed = {}
    for key, tensor in tensors.items():
        prefix, sep, rest = key.partition("vision_tower.")
        if sep and not rest.startswith("vision_model."):
            key = f"{prefix}vision_tower.vision_model.{rest}"
        renamed[key] = tensor
    save_file(renamed, weights, metadata={"format": "pt"})


def make_image(seed: int, size: int = IMAGE_SIZE) -> Image.Image:
    """A deterministic ``size`` x ``size`` RGB image of random coloured pixels (56 px, the
    tests' tower, by default; give ``DEMO_TOWER.image_size`` for the demo's model)."""
    from PIL import Image

    rng = random.Random(seed)
    data = bytes(rng.randrange(256) for _ in range(size * size * 3))
    return Image.frombytes("RGB", (size, size), data)


def image_data_url(img: Image.Image) -> str:
    """The image as a base64 PNG ``data:`` URL, as an OpenAI-style client sends it."""
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
