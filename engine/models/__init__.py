"""The model registry: architecture name -> implementation, or a clear refusal."""
from __future__ import annotations

from engine.errors import ModelLoadError

# Architectures implemented by the generic decoder (engine/models/decoder.py).
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gpt2", "granite", "phi3", "olmo2",
             "gpt_oss", "gpt-oss")      # gpt-oss: llama.cpp's GGUF name

# Mixture-of-experts architectures (the decoder with engine/models/moe.py MLPs); GGUF spellings included
# (llama.cpp writes Mixtral as "llama" with {arch}.expert_count).
MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "qwen2moe", "qwen3moe")

# Multi-head latent attention (engine/models/mla.py): DeepSeek-V2 / V3, dense or MoE
MLA = ("deepseek_v2", "deepseek_v3", "deepseek2")      # deepseek2: llama.cpp's GGUF name for both

# Bidirectional encoders for embeddings (engine/models/encoder.py; engine.pooling)
ENCODERS = ("bert",)

# Architectures whose config we can read but whose model code is not written yet: what is missing.
KNOWN_UNIMPLEMENTED = {
    "falcon": "Falcon's parallel attention/MLP block and ALiBi",
    "mamba": "selective state-space (Mamba) layers",
    "qwen3_next": "gated delta-net (linear attention) layers",
}


def build_model(ckpt, kv_dtype: str = "f32", device: str | None = "cpu", dtype: str = "auto"):
    """The model for `ckpt` on `device` ("auto" | "cpu" | "cuda"; see engine.device). dtype "auto" | "float32":
    the GPU compute precision of 16-bit checkpoints (DecoderLM)."""
    from engine.device import resolve_device
    arch = ckpt.config.architecture
    if arch in MLA and (device or "auto").strip().lower() == "auto":
        device = "cpu"          # MLA runs on the CPU only so far: "auto" must not pick a GPU it would refuse
    device = resolve_device(device)
    if arch in SUPPORTED or arch in MOE:
        from engine.models.decoder import DecoderLM
        return DecoderLM(ckpt, kv_dtype=kv_dtype, device=device, dtype=dtype)
    if arch in MLA:
        from engine.models.mla import MLADecoderLM
        return MLADecoderLM(ckpt, kv_dtype=kv_dtype, device=device)
    if arch in ENCODERS:
        if not getattr(ckpt, "pooling_only", False):
            raise ModelLoadError(f"'{arch}' is an encoder: it serves embeddings only (--task embed)",
                                 path=ckpt.path, key="architecture")
        from engine.models.encoder import BertEncoder
        return BertEncoder(ckpt, device=device)
    if arch in KNOWN_UNIMPLEMENTED:
        raise ModelLoadError(f"architecture '{arch}' is recognised but not implemented yet: missing "
                             f"{KNOWN_UNIMPLEMENTED[arch]}", path=ckpt.path, key="architecture")
    raise ModelLoadError(f"unknown architecture '{arch}' (supported: {', '.join(SUPPORTED)})", path=ckpt.path,
                         key="architecture")
