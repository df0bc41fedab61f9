"""The second path of `python -m export`: a checkpoint folder whose ``model_type`` the graph
builder (`export.graph`) does not know, but optimum-onnx exports as a causal LM with a KV cache
(``text-generation-with-past``), gets its graph from optimum instead of a refusal.

Which families: those of optimum's exporter for that task that transformers itself knows (no
remote code), less the native ones and every family refused by name and reason
(`export.model_spec.refusal_reason`: state-space, convolution and recurrent hybrids, linear
attention, experts, multimodal models, encoder-decoders), whatever optimum knows of them.

The folder holds optimum's graph as ``model.onnx`` + ``model.onnx.data``; its manifest says
``"builder": "optimum"`` and names the graph's inputs and its KV tensors (past in, present out:
``CONCAT_KV_LAYOUT``), which the runtime runs with :class:`specdec_rt.ort.ConcatKVModel`. It is
validated as the native graphs are (`export.validate`, through that runtime model).

optimum's exporter runs in a child process (its torch export, and the memory it holds, end with
it), offline: local files only, no remote code.
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec_rt.manifest_schema import CONCAT_KV_LAYOUT, LIMITS

from .errors import UnsupportedModelError, UsageError, one_line
from .model_spec import MAX_POSITIONS_CAP
from .optimum_families import OPTIMUM_TASK
from .source import Source
from .ui import Reporter

__all__ = ["OptimumGraph", "OptimumJob", "build_optimum_folder", "check_options", "optimum_version"]

GRAPH, DATA = "model.onnx", "model.onnx.data"
KV_NAMES = {
    "past_key": "past_key_values.{layer}.key",
    "past_value": "past_key_values.{layer}.value",
    "present_key": "present.{layer}.key",
    "present_value": "present.{layer}.value",
}
FED = ("input_ids", "attention_mask", "position_ids")  # the graph's inputs besides the past KV
CHILD_TAIL = 2000  # characters of the child's stderr an error keeps


@dataclass(frozen=True, kw_only=True)
class OptimumGraph:
    """What the folder's graph takes and gives, read from it."""

    nodes: int
    num_layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    position_ids: bool  # the graph takes position_ids

    def onnx_section(self) -> dict[str, Any]:
        """The manifest's ``onnx`` record."""
        return {
            "file": GRAPH,
            "data_file": DATA,
            "dtype": "float32",
            "quantization": None,
            "nodes": self.nodes,
            "inputs": {
                "input_ids": "input_ids",
                "attention_mask": "attention_mask",
                "position_ids": "position_ids" if self.position_ids else None,
            },
            "outputs": {"logits": "logits"},
            "kv": {"layout": CONCAT_KV_LAYOUT, "shared_buffer": False, "dtype": "float32", **KV_NAMES},
        }


def read_graph(folder: Path, family: str) -> OptimumGraph:
    """The record of ``folder/model.onnx`` (weights not loaded); an UnsupportedModelError when
    its inputs or KV tensors are not the ``text-generation-with-past`` form the runtime runs:
    ``input_ids``, ``attention_mask``, (``position_ids``), each layer's past key and value
    ``[batch, kv_heads, past, head_dim]`` with both sizes fixed, logits ``[batch, new, V]``."""
    import onnx

    graph = onnx.load(str(folder / GRAPH), load_external_data=False).graph
    shapes = {
        v.name: [d.dim_value if d.HasField("dim_value") else d.dim_param for d in v.type.tensor_type.shape.dim]
        for v in (*graph.input, *graph.output)
    }
    inputs = [i.name for i in graph.input]
    layers = sum(1 for name in inputs if name.startswith("past_key_values.") and name.endswith(".key"))
    past = {KV_NAMES[r].format(layer=i) for i in range(layers) for r in ("past_key", "past_value")}
    present = {KV_NAMES[r].format(layer=i) for i in range(layers) for r in ("present_key", "present_value")}
    odd = sorted(set(inputs) - past - set(FED)) + sorted((past | present) - set(shapes))
    kv = [shapes.get(name, []) for name in sorted(past)]
    fixed = {(s[1], s[3]) for s in kv if len(s) == 4}
    logits = shapes.get("logits", [])
    if odd or not layers or len(fixed) != 1 or len(kv[0]) != 4 or "attention_mask" not in inputs or len(logits) != 3:
        what = f"inputs {', '.join(odd[:3])}" if odd else f"KV shapes {kv[:1]}, logits {logits}"
        raise UnsupportedModelError(
            f"{family}: optimum's graph has {what}; the runtime runs [batch, kv_heads, past, head_dim]"
        )
    heads, head_dim = fixed.pop()
    if not all(isinstance(n, int) and n > 0 for n in (heads, head_dim, logits[2])):
        raise UnsupportedModelError(f"{family}: optimum's graph leaves its KV heads, head size or vocabulary open")
    return OptimumGraph(
        nodes=len(graph.node),
        num_layers=layers,
        kv_heads=heads,
        head_dim=head_dim,
        vocab_size=int(logits[2]),
        position_ids="position_ids" in inputs,
    )


def export_graph(src: Path, folder: Path, *, family: str, threads: int | None) -> OptimumGraph:
    """Run optimum's exporter on the checkpoint folder ``src`` in a child process and write its
    graph as ``folder/model.onnx`` + ``model.onnx.data`` (every weight in the one data file)."""
    with tempfile.TemporaryDirectory(prefix=".optimum-", dir=folder) as work:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent), *sys.path])}
        argv = [sys.executable, "-c", "import sys, export.optimum_path as o; o.child(sys.argv[1:])"]
        args = [str(src), work, str(folder), str(threads or 0)]
        done = subprocess.run(argv + args, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if done.returncode != 0:
            tail = one_line(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}")
            raise UnsupportedModelError(f"optimum-onnx could not export {family}: {tail[-CHILD_TAIL:]}")
    return read_graph(folder, family)


def child(argv: list[str]) -> None:
    """The child process: optimum's export of ``src`` into ``work``, saved into ``out``."""
    src, work, out, threads = argv
    import torch
    from optimum.exporters.onnx import main_export

    if int(threads):
        torch.set_num_threads(int(threads))
    main_export(
        model_name_or_path=src,
        output=work,
        task=OPTIMUM_TASK,
        framework="pt",
        library_name="transformers",
        local_files_only=True,
        trust_remote_code=False,
        no_post_process=True,
        do_validation=False,
    )
    place_graph(Path(work), Path(out))


def place_graph(work: Path, out: Path) -> None:
    """optimum's ``work/model.onnx`` as ``out/model.onnx`` + ``out/model.onnx.data``. Weights in
    the graph itself (a model under 2 GB) are written out to the data file; weights already in
    one data file beside it (optimum's ``model.onnx_data`` for larger ones) keep it, moved and
    renamed, the graph's references rewritten: never loaded, so no second copy in memory."""
    import onnx
    from onnx.external_data_helper import uses_external_data

    model = onnx.load(str(work / GRAPH), load_external_data=False)
    # (every tensor, initializers and constants in subgraphs too: onnx's own walk, pinned onnx)
    tensors = [t for t in onnx.external_data_helper._get_all_tensors(model) if uses_external_data(t)]
    where = {entry.value for t in tensors for entry in t.external_data if entry.key == "location"}
    if len(where) == 1 and (work / next(iter(where))).resolve().parent == work.resolve():
        shutil.move(work / where.pop(), out / DATA)
        for tensor in tensors:
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = DATA
        onnx.save_model(model, str(out / GRAPH))
        return
    model = onnx.load(str(work / GRAPH))  # embedded weights (or several files): all loaded
    onnx.save_model(
        model,
        str(out / GRAPH),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=DATA,
        size_threshold=0,
    )


def max_positions(config: Any, asked: int | None) -> int:
    """The positions the folder holds: the model's (``max_position_embeddings``), capped at
    ``MAX_POSITIONS_CAP`` and at ``asked`` (--max-positions)."""
    own = getattr(config, "max_position_embeddings", None)
    if not isinstance(own, int) or own < 2:
        own = MAX_POSITIONS_CAP
    return min(own, MAX_POSITIONS_CAP, asked or MAX_POSITIONS_CAP)


def architecture(config: Any, graph: OptimumGraph, positions: int) -> dict[str, Any]:
    """The manifest's ``architecture`` record: the graph's sizes, the config's widths."""
    record = {
        "family": config.model_type,
        "num_layers": graph.num_layers,
        "hidden_size": getattr(config, "hidden_size", None),
        "num_heads": getattr(config, "num_attention_heads", None),
        "num_kv_heads": graph.kv_heads,
        "head_dim": graph.head_dim,
        "vocab_size": graph.vocab_size,
        "max_positions": positions,
    }
    for key, (lo, hi) in LIMITS.items():
        value = record[key]
        if not isinstance(value, int) or not lo <= value <= hi:
            raise UnsupportedModelError(f"{config.model_type}: {key} {value!r} is not an integer from {lo} to {hi}")
    if graph.kv_heads > record["num_heads"]:
        raise UnsupportedModelError(f"{config.model_type}: {graph.kv_heads} KV heads but {record['num_heads']} heads")
    return record


def check_options(family: str, *, quantize: str | None, kv_dtype: str, head: bool) -> None:
    """A UsageError for an option only the native graph builder offers."""
    asked = [
        what
        for what, on in (("--quantize / --draft-quant", quantize), ("--kv-dtype float16", kv_dtype != "float32"))
        if on
    ] + (["a trained draft head"] if head else [])
    if asked:
        raise UsageError(
            f"{family} is built through optimum (not a native family): {', '.join(asked)} "
            "needs a native family (docs/export.md)"
        )


@dataclass(frozen=True, kw_only=True)
class OptimumJob:
    """One folder to build through optimum: who it is and where it goes."""

    name: str
    role: str
    folder: Path
    max_positions: int | None
    validate: bool
    threads: int | None


def build_optimum_folder(job: OptimumJob, src: Source, tok: Any, ui: Reporter) -> dict[str, Any]:
    """Build ``job.folder`` through optimum: PyTorch reference (when validating), optimum's
    graph, tokenizer files, validation through the runtime. Returns the manifest's ``name``,
    ``role``, ``builder``, ``architecture`` and ``onnx``, with ``tok`` (the TokenizerInfo) and
    ``validation`` (its record, or None) for the caller's :func:`export.manifest.assemble_manifest`."""
    from .tokenizer import check_encoding, save_tokenizer
    from .validate import new_tokens, prompt_ids, reference_logits, validate_graph

    job.folder.mkdir(parents=True)
    with ui.stage(f"load {job.name} weights ({src.path.name})"):
        model = src.load_model()
        config, generation = model.config, model.generation_config
        positions = max_positions(config, job.max_positions)
    ref = None
    if job.validate:
        with ui.stage(f"PyTorch reference for {job.name}"):
            ids = prompt_ids(tok, config.vocab_size, positions)
            ref = (*reference_logits(model, ids, new_tokens(positions, len(ids))), len(ids))
    del model
    gc.collect()
    ui.log(f"{job.name}: {src.family} is not a native family; its graph is built through optimum-onnx")
    with ui.stage(f"write ONNX graph for {job.name} through optimum"):
        graph = export_graph(src.folder, job.folder, family=src.family, threads=job.threads)
    info = save_tokenizer(tok, job.folder, generation)
    check_encoding(job.folder, info)
    fields = {
        "name": job.name,
        "role": job.role,
        "builder": "optimum",
        "architecture": architecture(config, graph, positions),
        "onnx": graph.onnx_section(),
    }
    report = None
    if ref is not None:
        with ui.stage(f"validate {job.name} against PyTorch"):
            seq, logits, prompt_len = ref
            report = validate_graph(job.folder, fields, seq, logits, prompt_len=prompt_len, threads=job.threads)
    return fields | {"tok": info, "validation": report.manifest() if report else None}


def optimum_version() -> str:
    """optimum-onnx's version, for the manifest's ``build`` record and ``exact_to``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("optimum-onnx")
    except PackageNotFoundError:
        return "unknown"
