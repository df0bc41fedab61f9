"""Hugging Face baselines for the benchmark: transformers ``generate`` (PyTorch) plain, assisted
and prompt-lookup decoding, and optimum's ONNX Runtime model. Needs torch + transformers (the
``export`` extra) and, for ``optimum_ar``, optimum-onnx (the ``bench`` extra).

The PyTorch model is loaded from where the export came from (``manifest.source``): a checkpoint
folder, or the GGUF file (dequantized, the same float weights the ONNX export was built from).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import ModelLoadError

if TYPE_CHECKING:
    from ...ort.manifest import Manifest

# a baseline's answer: the new ids and the seconds generate() took
BaselineResult = tuple[list[int], float]

__all__ = ["HFBaselines", "load_source_model"]


def _source_of(manifest: Manifest) -> tuple[Path, str | None]:
    """``(folder, gguf file name or None)`` the manifest says the weights came from: a recipe's
    file inside the download cache (a name, no path), or the checkpoint folder or GGUF file it
    was exported from (read as safetensors or GGUF only: never a pickle, whoever wrote the manifest)."""
    from ...ort.manifest import _short, cache_root, inside

    src = manifest.raw.get("source") or {}
    if not isinstance(src, dict):
        raise ModelLoadError(f"{manifest.folder / 'manifest.json'}: source must be an object")
    path = src.get("path")
    if src.get("kind") == "recipe" and src.get("file"):  # fetched into the cache by python -m export
        path = str(inside(cache_root() / "downloads", src["file"], "source.file", manifest.folder / "manifest.json"))
    if isinstance(path, str) and path.endswith(".gguf") and Path(path).is_file():
        return Path(path).parent, Path(path).name
    if isinstance(path, str) and Path(path).is_dir():
        return Path(path), None
    raise ModelLoadError(
        f"{manifest.folder / 'manifest.json'}: source {_short(src)} names no checkpoint "
        "folder or GGUF file on this machine (the Hugging Face modes need one)"
    )


def _slug(name: str) -> str:
    """A manifest's name as one safe path component (it is written by whoever made the folder)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".")[:100] or "model"


def load_source_model(manifest: Manifest, threads: int) -> Any:
    """The PyTorch model the export was built from, float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    folder, gguf = _source_of(manifest)
    kw: dict[str, object] = {"gguf_file": gguf} if gguf else {}
    kw = kw or {"use_safetensors": True}  # a folder's *.bin would be unpickled
    model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw)
    return model.eval()


class HFBaselines:
    """Runs the Hugging Face modes on prompt ids; each call returns ``(new_ids, seconds)``."""

    def __init__(
        self,
        manifest: Manifest,
        draft_manifest: Manifest | None = None,
        *,
        threads: int = 2,
        cache_dir: Path | None = None,
        log: Callable[[str], object] = print,
    ) -> None:
        import torch

        self.torch = torch
        self.manifest, self.log = manifest, log
        self.model = load_source_model(manifest, threads)
        self.eos = list(manifest.eos_ids)
        self._assistant: Any = None  # a PyTorch model
        self._draft_manifest = draft_manifest
        self._optimum: Any = None  # optimum's ORTModelForCausalLM
        self._cache_dir = cache_dir
        self.threads = threads
        self.assistant_kind: str | None = None

    def _generate(self, model: Any, ids: Sequence[int], n: int, **kw: Any) -> BaselineResult:
        torch = self.torch
        x = torch.tensor([list(ids)])
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=self.eos,
                pad_token_id=self.eos[0],
                **kw,
            )
        dt = time.perf_counter() - t
        # prompt lookup can overshoot max_new_tokens within its last round: keep n, as we do
        new: list[int] = out[0, x.shape[1] :][:n].tolist()
        return new, dt

    def hf_ar(self, ids: Sequence[int], n: int) -> BaselineResult:
        return self._generate(self.model, ids, n)

    def hf_prompt_lookup(self, ids: Sequence[int], n: int) -> BaselineResult:
        return self._generate(self.model, ids, n, prompt_lookup_num_tokens=10)

    def hf_assisted(self, ids: Sequence[int], n: int) -> BaselineResult:
        return self._generate(self.model, ids, n, assistant_model=self.assistant())

    def assistant(self) -> Any:
        """The draft in PyTorch: the draft's own source checkpoint if it has one, else a dynamic
        int8 copy of the target (the closest PyTorch analogue of a quantized-copy draft)."""
        if self._assistant is None:
            dm = self._draft_manifest
            if dm is not None and "derived" not in (dm.raw.get("source") or {}):  # its own checkpoint
                try:
                    self._assistant = load_source_model(dm, self.threads)
                    self.assistant_kind = f"{dm.name} (PyTorch float32)"
                except Exception:  # noqa: BLE001 - fall back to the int8 copy below
                    self._assistant = None
            if self._assistant is None:
                import copy

                torch = self.torch
                self._assistant = torch.ao.quantization.quantize_dynamic(
                    copy.deepcopy(self.model), {torch.nn.Linear}, dtype=torch.qint8
                )
                self.assistant_kind = "dynamic int8 copy of the target (PyTorch)"
        return self._assistant

    def optimum_ar(self, ids: Sequence[int], n: int) -> BaselineResult:
        import numpy as np

        model = self._optimum_model()
        x = np.array([list(ids)], dtype=np.int64)
        import torch

        t = time.perf_counter()
        out = model.generate(
            torch.tensor(x),
            attention_mask=torch.ones(x.shape, dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=self.eos,
            pad_token_id=self.eos[0],
        )
        dt = time.perf_counter() - t
        new: list[int] = out[0, x.shape[1] :].tolist()
        return new, dt

    def _optimum_model(self) -> Any:
        if self._optimum is None:
            import onnxruntime as ort
            from optimum.onnxruntime import ORTModelForCausalLM

            from ...ort.manifest import cache_root
            from ...ort.setup import _configure_threads

            cache_dir = self._cache_dir or cache_root() / "bench"
            folder = cache_dir / f"optimum-{_slug(self.manifest.name)}"

            so = ort.SessionOptions()
            _configure_threads(so, self.threads)  # the same thread-pool rules as our models
            if not (folder / "model.onnx").exists():
                hf_dir = cache_dir / f"hf-{_slug(self.manifest.name)}"
                if not (hf_dir / "config.json").exists():
                    self.log(f"saving the PyTorch checkpoint for optimum to {hf_dir}")
                    self.model.save_pretrained(hf_dir)
                self.log("exporting with optimum (once; cached)")
                # in a child process: optimum's exporter opens ONNX Runtime sessions of its own,
                # which a process with a global thread pool (ours) refuses
                code = (
                    "import sys; from optimum.onnxruntime import ORTModelForCausalLM as M; "
                    "M.from_pretrained(sys.argv[1], export=True, use_cache=True).save_pretrained(sys.argv[2])"
                )
                subprocess.run([sys.executable, "-c", code, str(hf_dir), str(folder)], check=True)
            self._optimum = ORTModelForCausalLM.from_pretrained(
                folder, use_cache=True, use_io_binding=False, session_options=so
            )
        return self._optimum
