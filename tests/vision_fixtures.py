"""A tiny random LLaVA (CLIP vision tower + projector + Llama decoder) saved as a safetensors checkpoint with a
word-level tokenizer whose id 255 is the image token "<image>" (nothing is downloaded)."""
from __future__ import annotations

import json
import os

VOCAB = 256
IMAGE_TOKEN_ID = 255
IMAGE_SIZE = 32
PATCH = 8

# A LLaVA-style template: string contents as they are, content-part lists with "<image>" where an image goes
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }} {% else %}"
                 "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image> {% elif c['type'] == 'text' %}"
                 "{{ c['text'] }} {% endif %}{% endfor %}{% endif %}{% endfor %}")

VARIANTS = {
    # llava-1.5's choices: the penultimate layer, CLS dropped, quick_gelu in the tower
    "default": dict(vision_feature_layer=-2, vision_feature_select_strategy="default", hidden_act="quick_gelu"),
    # several feature layers side by side, the CLS row kept, exact GELU in the tower
    "full-multi": dict(vision_feature_layer=[0, -1], vision_feature_select_strategy="full", hidden_act="gelu"),
}


def num_features(variant: str) -> int:
    n = (IMAGE_SIZE // PATCH) ** 2
    return n + (1 if VARIANTS[variant]["vision_feature_select_strategy"] == "full" else 0)


def _tokenizer(path: str) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    vocab = {f"t{i}": i for i in range(VOCAB - 1)}
    vocab["<image>"] = IMAGE_TOKEN_ID
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": None, "eos_token": "t1", "add_bos_token": False, "chat_template": CHAT_TEMPLATE}, f)


def make_llava_dir(path: str, variant: str = "default", seed: int = 0):
    """Builds and saves the tiny LLaVA of `variant` (VARIANTS) under `path`; returns the HF model (float32, eval)."""
    import torch
    import transformers as tf
    torch.manual_seed(seed)
    v = VARIANTS[variant]
    vc = tf.CLIPVisionConfig(image_size=IMAGE_SIZE, patch_size=PATCH, hidden_size=48, intermediate_size=80,
                             num_hidden_layers=2, num_attention_heads=4, hidden_act=v["hidden_act"])
    txt = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, eos_token_id=1, bos_token_id=None, rms_norm_eps=1e-5)
    cfg = tf.LlavaConfig(vision_config=vc, text_config=txt, image_token_index=IMAGE_TOKEN_ID,
                         vision_feature_layer=v["vision_feature_layer"],
                         vision_feature_select_strategy=v["vision_feature_select_strategy"],
                         image_seq_length=num_features(variant))
    model = tf.LlavaForConditionalGeneration(cfg).eval()
    # random norms and larger vision weights than HF's init (0.02), so that a wrong formula anywhere in the tower
    # moves the features well past the tolerances
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "layrnorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif "vision_tower" in name or "multi_modal_projector" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer(path)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump({"image_processor_type": "CLIPImageProcessor", "do_resize": True,
                   "size": {"shortest_edge": IMAGE_SIZE}, "do_center_crop": True,
                   "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}, "do_rescale": True,
                   "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True, "resample": 3,
                   "image_mean": [0.48145466, 0.4578275, 0.40821073],
                   "image_std": [0.26862954, 0.26130258, 0.27577711]}, f)
    return model


def hf_greedy_with_images(hf, ids, pixels, n: int) -> list:
    """transformers' greedy continuation (exactly n tokens) of `ids` with the processed images `pixels`."""
    import numpy as np
    import torch

    from tests.model_compare import hf_greedy
    return hf_greedy(hf, ids, n, pixel_values=torch.from_numpy(np.stack(pixels)))


def random_image(seed: int, size=(45, 37)):
    """A random RGB PIL image (not square, so the resize and the crop both matter)."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")
