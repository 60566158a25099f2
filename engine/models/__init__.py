"""The model registry: architecture name -> implementation, or a clear refusal. Which implementation an
architecture takes is its record's `model` in engine/models/arch.py."""
from __future__ import annotations

from engine.errors import ModelLoadError
from engine.models import arch as _arch

# Architectures implemented by the generic decoder (engine/models/decoder.py); mixture-of-experts ones among them
# run engine/models/moe.py MLPs (a checkpoint is sparse when its config / metadata counts experts)
SUPPORTED = _arch.names("decoder")
# Multi-head latent attention (engine/models/mla.py): DeepSeek-V2 / V3, dense or MoE
MLA = _arch.names("mla")
# Bidirectional encoders for embeddings (engine/models/encoder.py; engine.pooling)
ENCODERS = _arch.names("encoder")
# Speech recognition (engine/models/whisper.py): transcription only (engine.transcription)
SPEECH = _arch.names("whisper")
# Architectures whose config we can read but whose model code is not written yet: what is missing.
KNOWN_UNIMPLEMENTED = {a.name: a.missing for a in _arch.ARCHS if a.model == "unimplemented"}


def build_model(ckpt, kv_dtype: str = "f32", device: str | None = "cpu", dtype: str = "auto"):
    """The model for `ckpt` on `device` ("auto" | "cpu" | "cuda"; see engine.device). dtype "auto" | "float32":
    the GPU compute precision of 16-bit checkpoints (DecoderLM)."""
    from engine.device import resolve_device
    arch = ckpt.config.architecture
    rec = _arch.arch_of(arch)
    model = rec.model if _arch.known(arch) else None
    from engine.models.llava import is_llava
    if model == "mla" and (device or "auto").strip().lower() == "auto":
        device = "cpu"          # MLA runs on the CPU only so far: "auto" must not pick a GPU it would refuse
    device = resolve_device(device)
    if model == "decoder":
        from engine.models.decoder import DecoderLM
        from engine.models.llava import LlavaVision
        if is_llava(ckpt.config) and device not in ("cpu", "cuda"):
            raise ModelLoadError(f"LLaVA (image input) runs on the CPU and CUDA only so far, not {device}: use "
                                 "--device cpu or cuda", path=ckpt.path, key="device")
        lm = DecoderLM(ckpt, kv_dtype=kv_dtype, device=device, dtype=dtype)
        if is_llava(ckpt.config):
            lm.vision = LlavaVision(ckpt, device)       # takes image input (engine.multimodal)
        return lm
    if model == "mla":
        from engine.models.mla import MLADecoderLM
        return MLADecoderLM(ckpt, kv_dtype=kv_dtype, device=device)
    if model == "encoder":
        if not getattr(ckpt, "pooling_only", False):
            raise ModelLoadError(f"'{arch}' is an encoder: it serves embeddings only (--task embed)",
                                 path=ckpt.path, key="architecture")
        from engine.models.encoder import BertEncoder
        return BertEncoder(ckpt, device=device)
    if model == "whisper":
        if device not in ("cpu", "cuda"):
            raise ModelLoadError(f"Whisper (transcription) runs on the CPU and CUDA only so far, not {device}: use "
                                 "--device cpu or cuda", path=ckpt.path, key="device")
        from engine.models.whisper import WhisperModel
        return WhisperModel(ckpt, device)
    if model == "unimplemented":
        raise ModelLoadError(f"architecture '{arch}' is recognised but not implemented yet: missing "
                             f"{rec.missing}", path=ckpt.path, key="architecture")
    raise ModelLoadError(f"unknown architecture '{arch}' (supported: {', '.join(SUPPORTED)})", path=ckpt.path,
                         key="architecture")
