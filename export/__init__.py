"""`python -m export`: Hugging Face checkpoints and GGUF files to ONNX + manifest.json.

The output folder is what the `specdec_rt` runtime loads (docs/manifest.md). The manifest's
schema is the runtime's `specdec_rt.manifest_schema`, the one module both packages share;
validation runs the graph through the runtime's `specdec_rt.ort`. A checkpoint of a family the
graph builder lacks, that optimum-onnx exports, is built through optimum (`export.optimum_path`).
This package needs the `export` extra (torch, transformers, onnx, onnxruntime, gguf,
optimum-onnx); the runtime never imports it
(except to build a recipe that is missing).

    python -m export smollm2-135m                  # a recipe from models/, into the cache
    python -m export ./checkpoint --out out/ --draft-quant int4
    python -m export model.gguf --out out/ --draft ./small-checkpoint
"""

__version__ = "0.4.0"

__all__ = ["__version__"]
