"""Image input for vision-language models (LLaVA: engine/models/llava.py).

A request's prompt may carry images as vLLM's `{"prompt": ..., "multi_modal_data": {"image": PIL.Image or a
list of them}}`. Each image is

  * preprocessed as transformers' CLIPImageProcessor (and LlavaImageProcessor) does, driven by the checkpoint's
    preprocessor_config.json: RGB, optional pad to a square in the mean colour, resize of the shortest edge
    (bicubic), center crop, rescale (1/255), normalise by the mean and std -> pixel values [C, S, S];
  * given a placeholder range in the prompt: the model's image token is expanded to one token per feature row
    the vision tower gives (a prompt that already holds the expanded runs keeps them);
  * hashed (sha256 of its pixel values): the prefix cache keys every block that holds one of its tokens by that
    hash too (KVCacheManager.update_block_hashes, as vLLM's mm_hashes), so two prompts whose tokens are equal
    but whose images differ never share those blocks.

The features themselves are computed on the engine thread when a step first needs them (ModelRunner.prepare):
a prefix-cache hit over a whole image needs no encoder run at all.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.errors import InvalidRequestError

# transformers' OPENAI_CLIP_MEAN / OPENAI_CLIP_STD: CLIPImageProcessor's defaults
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_IMAGES_PER_PROMPT = 16


@dataclass(eq=False)
class ImageInput:
    """One image of a request: where its tokens are in the prompt, what the vision tower reads, its hash."""
    offset: int                      # first placeholder position in the prompt
    length: int                      # placeholder tokens (= feature rows)
    pixel_values: np.ndarray         # f32 [C, S, S]
    hash: str                        # sha256 hex of the pixel values
    embeds: np.ndarray | None = field(default=None, repr=False)   # [length, hidden] once computed

    @property
    def end(self) -> int:
        return self.offset + self.length


class ImageProcessor:
    """CLIPImageProcessor's steps with Pillow and numpy (preprocessor_config.json's keys and defaults)."""

    def __init__(self, config: dict | None = None, image_size: int = 224):
        c = dict(config or {})
        size = c.get("size", {"shortest_edge": image_size})
        if isinstance(size, int):
            size = {"shortest_edge": size}
        crop = c.get("crop_size", {"height": image_size, "width": image_size})
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        self.size = dict(size)
        self.crop = (int(crop["height"]), int(crop["width"]))
        self.do_resize = bool(c.get("do_resize", True))
        self.do_center_crop = bool(c.get("do_center_crop", True))
        self.do_rescale = bool(c.get("do_rescale", True))
        self.do_normalize = bool(c.get("do_normalize", True))
        self.do_pad = bool(c.get("do_pad", False))
        self.do_convert_rgb = bool(c.get("do_convert_rgb", True))
        self.rescale_factor = float(c.get("rescale_factor", 1 / 255))
        self.mean = tuple(float(x) for x in c.get("image_mean", CLIP_MEAN))
        self.std = tuple(float(x) for x in c.get("image_std", CLIP_STD))
        self.resample = int(c.get("resample", 3))        # PIL's BICUBIC

    @classmethod
    def from_dir(cls, path, image_size: int) -> "ImageProcessor":
        """From a model folder's preprocessor_config.json, else CLIP's defaults at the tower's image size."""
        p = Path(path)
        f = (p if p.is_dir() else p.parent) / "preprocessor_config.json"
        if not f.is_file():
            return cls(None, image_size)
        from engine.errors import read_json_object
        return cls(read_json_object(f), image_size)

    def _resize_to(self, h: int, w: int) -> tuple:
        s = self.size
        if s.get("shortest_edge"):
            short, long = (w, h) if w <= h else (h, w)
            new_short, new_long = int(s["shortest_edge"]), int(int(s["shortest_edge"]) * long / short)
            return (new_long, new_short) if w <= h else (new_short, new_long)
        return int(s["height"]), int(s["width"])

    def __call__(self, image) -> np.ndarray:
        """Pixel values f32 [3, H, W] of a PIL image."""
        from PIL import Image
        if self.do_convert_rgb and image.mode != "RGB":
            image = image.convert("RGB")
        if self.do_pad and image.width != image.height:
            side = max(image.width, image.height)
            bg = tuple(int(x * 255) for x in self.mean)
            sq = Image.new(image.mode, (side, side), bg)
            sq.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
            image = sq
        if self.do_resize:
            h, w = self._resize_to(image.height, image.width)
            if (h, w) != (image.height, image.width):
                image = image.resize((w, h), resample=self.resample)
        a = np.asarray(image, dtype=np.float64)
        if a.ndim == 2:
            a = a[:, :, None]
        a = a.transpose(2, 0, 1)                       # channels first, as the tower reads them
        if self.do_center_crop:
            a = _center_crop(a, *self.crop)
        if self.do_rescale:
            a = a * self.rescale_factor
        if self.do_normalize:
            a = (a - np.asarray(self.mean)[:, None, None]) / np.asarray(self.std)[:, None, None]
        return np.ascontiguousarray(a, np.float32)


def _center_crop(a: np.ndarray, ch: int, cw: int) -> np.ndarray:
    _, h, w = a.shape
    if h < ch or w < cw:                               # smaller than the crop: zero-padded around it first
        ph, pw = max(ch, h), max(cw, w)
        big = np.zeros((a.shape[0], ph, pw), a.dtype)
        top, left = (ph - h) // 2, (pw - w) // 2
        big[:, top:top + h, left:left + w] = a
        a, h, w = big, ph, pw
    top, left = (h - ch) // 2, (w - cw) // 2
    return a[:, top:top + ch, left:left + cw]


def image_hash(pixels: np.ndarray) -> str:
    h = hashlib.sha256(b"jitkern-image\0")
    h.update(repr((pixels.dtype.str, pixels.shape)).encode())
    h.update(np.ascontiguousarray(pixels).tobytes())
    return h.hexdigest()


def images_of(mm_data, param: str = "multi_modal_data") -> list:
    """The PIL images of a prompt's multi_modal_data ({"image": image or list}); refuses anything else."""
    if not isinstance(mm_data, dict):
        raise InvalidRequestError("multi_modal_data must be a dict such as {'image': PIL.Image}", param=param)
    unknown = sorted(set(mm_data) - {"image"})
    if unknown:
        raise InvalidRequestError(f"multi_modal_data[{unknown[0]!r}] is not supported (only 'image')",
                                  param=f"{param}.{unknown[0]}")
    imgs = mm_data.get("image")
    if imgs is None:
        return []
    imgs = list(imgs) if isinstance(imgs, (list, tuple)) else [imgs]
    try:
        from PIL import Image
    except ImportError:     # pragma: no cover - Pillow is a dependency
        raise InvalidRequestError("image input needs Pillow (pip install pillow)", param=param) from None
    for i, im in enumerate(imgs):
        if not isinstance(im, Image.Image):
            raise InvalidRequestError(f"multi_modal_data['image'][{i}] is a {type(im).__name__}, not a PIL image",
                                      param=f"{param}.image")
    if len(imgs) > MAX_IMAGES_PER_PROMPT:
        raise InvalidRequestError(f"{len(imgs)} images in one prompt; at most {MAX_IMAGES_PER_PROMPT}",
                                  param=f"{param}.image")
    return imgs


MAX_IMAGE_PIXELS = 64 * 1024 * 1024      # a decoded image larger than this is refused (decompression bombs)


def image_from_data_url(url: str, where: str):
    """The PIL image of a base64 data: URL (an OpenAI image_url part's url; nothing is downloaded). Raises
    InvalidRequestError naming `where` (the part)."""
    if not url.startswith("data:"):
        raise InvalidRequestError(f"'{where}.image_url.url' must be a data: URL (data:image/png;base64,...): this "
                                  "server does not download images", param=f"{where}.image_url.url")
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise InvalidRequestError(f"'{where}.image_url.url' must be a base64 data: URL (data:image/png;base64,...)",
                                  param=where)
    import base64
    import binascii
    import io
    import warnings
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(f"'{where}' holds invalid base64 data", param=where) from None
    from PIL import Image
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(raw))
            if img.width * img.height > MAX_IMAGE_PIXELS:
                raise InvalidRequestError(f"'{where}' is a {img.width}x{img.height} image; at most "
                                          f"{MAX_IMAGE_PIXELS} pixels", param=where)
            img.load()
    except InvalidRequestError:
        raise
    except Exception as e:      # noqa: BLE001 - whatever Pillow says, the part is not a readable image
        raise InvalidRequestError(f"'{where}' is not a decodable image ({type(e).__name__}: {e})",
                                  param=where) from None
    return img


def fit_template_format(messages: list, template, placeholder: str) -> None:
    """Messages with images as the chat template takes them. A template that handles content parts (it looks at
    a part's type: LLaVA's do) gets the parts list, `{"type": "image"}` where each image goes. A template that
    renders content as a string gets the text with one placeholder line per image first (vLLM's "string"
    content format)."""
    if isinstance(template, dict):
        template = "\n".join(str(t) for t in template.values())
    if isinstance(template, str) and "image" in template and "type" in template:
        return
    for m in messages:
        c = m.get("content")
        if isinstance(c, list):
            n = sum(p["type"] == "image" for p in c)
            text = "\n".join(p["text"] for p in c if p["type"] == "text")
            m["content"] = (placeholder + "\n") * n + text


def chat_images(messages: list, template, placeholder: str | None) -> tuple:
    """(messages for the chat template, PIL images in prompt order) of an `LLM.chat` conversation whose contents
    may be lists of OpenAI / vLLM content parts: {"type": "text", "text": ...}, {"type": "image_url",
    "image_url": {"url": "data:image/png;base64,..."}} and {"type": "image_pil", "image_pil": PIL.Image}. Each
    image becomes a {"type": "image"} part (fit_template_format); `placeholder`: the model's image token text,
    None for a model without image input (an image part is then refused)."""
    from PIL import Image
    images, out = [], []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text", "")})
                continue
            if kind == "image_url":
                iu = part.get("image_url")
                url = iu.get("url") if isinstance(iu, dict) else iu
                if not isinstance(url, str):
                    raise InvalidRequestError(f"'{where}.image_url.url' must be a data: URL string",
                                              param=f"{where}.image_url.url")
                img = image_from_data_url(url, where)
            elif kind == "image_pil":
                img = part.get("image_pil")
                if not isinstance(img, Image.Image):
                    raise InvalidRequestError(f"'{where}.image_pil' is a {type(img).__name__}, not a PIL image",
                                              param=f"{where}.image_pil")
            else:
                raise InvalidRequestError(f"'{where}.type' {kind!r} is not supported ('text', 'image_url' and "
                                          "'image_pil' parts)", param=f"{where}.type")
            if placeholder is None:
                raise InvalidRequestError("this model does not take image input", param=where)
            images.append(img)
            parts.append({"type": "image"})
        msg = dict(m)
        msg["content"] = parts if any(p["type"] == "image" for p in parts) else \
            "\n".join(p["text"] for p in parts)
        out.append(msg)
    if images:
        fit_template_format(out, template, placeholder)
    return out, images


def expand_placeholders(ids: list, token_id: int, count: int, n_images: int, token_text: str = "the image token"):
    """(new ids, offsets): each of the prompt's `n_images` image tokens expanded to `count` of them, or, when the
    prompt already holds n_images runs of exactly `count`, those runs as they are."""
    pos = [i for i, t in enumerate(ids) if t == token_id]
    if len(pos) == n_images:
        out, offsets = [], []
        prev = 0
        for p in pos:
            out.extend(ids[prev:p])
            offsets.append(len(out))
            out.extend([token_id] * count)
            prev = p + 1
        out.extend(ids[prev:])
        return out, offsets
    if len(pos) == n_images * count:
        offsets = pos[::count]
        if all(pos[k * count + count - 1] == offsets[k] + count - 1 for k in range(n_images)):
            return list(ids), offsets
    raise InvalidRequestError(f"the prompt has {len(pos)} {token_text} placeholder(s) (id {token_id}) for "
                              f"{n_images} image(s): put one placeholder where each image goes", param="prompt")


class ImageInputs:
    """The engine's image front end for a model with a vision tower (`model.vision`)."""

    def __init__(self, model, path, tokenizer=None):
        self.vision = model.vision
        vc = self.vision.cfg
        self.token_id = vc.image_token_id
        self.count = vc.num_features
        self.processor = ImageProcessor.from_dir(path, vc.image_size)
        self.image_size = vc.image_size
        tok = None
        if tokenizer is not None:
            try:
                tok = tokenizer.decode([self.token_id], skip_special_tokens=False)
            except Exception:       # noqa: BLE001 - the token's text only names it in messages
                tok = None
        self.token_text = tok or "<image>"

    def prepare(self, ids: list, images: list) -> tuple:
        """(expanded prompt ids, [ImageInput]) for a prompt and its PIL images."""
        ids, offsets = expand_placeholders(ids, self.token_id, self.count, len(images), repr(self.token_text))
        out = []
        for off, im in zip(offsets, images):
            px = self.processor(im)
            want = (self.vision.cfg.num_channels, self.image_size, self.image_size)
            if px.shape != want:
                raise InvalidRequestError(f"the image preprocesses to {list(px.shape)} pixel values; the vision "
                                          f"tower takes {list(want)} (check preprocessor_config.json)",
                                          param="multi_modal_data")
            out.append(ImageInput(off, self.count, px, image_hash(px)))
        return ids, out



def ensure_embeds(vision, images: list) -> None:
    """Runs the vision tower (one batch) for the images whose features are not computed yet."""
    todo = list({id(im): im for im in images if im.embeds is None}.values())
    if not todo:
        return
    from engine.ops._hostargs import host_copy
    # kept on the host (a GPU tower's output is copied back once): the steps that cover an image's rows (chunked
    # prefill may split them) take slices of it, staged with the step (ModelRunner._send_step)
    feats = host_copy(vision.encode(np.stack([im.pixel_values for im in todo])))
    for im, f in zip(todo, feats):
        im.embeds = np.ascontiguousarray(f, np.float32)
