"""The NVIDIA-only paths of the GPU lowering, composed into the NVPTX lowering only (backends/nvptx.py
NvptxLowering): warpgroup MMAs (wgmma.py) and asynchronous operand copies, cp.async and TMA (staging.py)."""
