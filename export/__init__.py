"""`python -m export`: Hugging Face checkpoints and GGUF files to ONNX + manifest.json.

The output folder is what the `specdec_rt` runtime loads; the two packages share only the
manifest format (docs/manifest.md). This package needs the `export` extra (torch,
transformers, onnx, onnxruntime, gguf); the runtime never imports it.

    python -m export smollm2-135m                  # a recipe from models/, into the cache
    python -m export ./checkpoint --out out/ --draft-quant int4
    python -m export model.gguf --out out/ --draft ./small-checkpoint
"""

__version__ = "0.4.0"

__all__ = ["__version__"]
