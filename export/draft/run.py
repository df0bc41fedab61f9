"""`python -m export train-draft`: data -> features/labels -> training -> ONNX draft -> validation.

Every stage is resumable from ``OUT/work`` (shards, vocabulary, checkpoints), so a useful draft
can be trained over several sessions: ``--time-budget`` stops cleanly (checkpoint written) and
``--resume`` continues where the last run stopped. The stages:

    data      the target answers training prompts (greedy, batched PyTorch); every position's
              normalised hidden state and top-k next-token distribution -> work/data/{val,train}
    corpus    (--corpus) text on the machine, teacher-forced by the target -> work/data/corpus
    features  (--features-from) the same tokens read again by a quantized copy of the target
              (ONNX Runtime): its hidden states and top-k -> work/features/{val,train,corpus}
    train     EAGLE head, multi-depth unrolled training, best checkpoint by validation top-1
    export    head.npz (float16, what ships) -> draft/ (ONNX + manifest, assembled with the target)
    validate  ONNX vs PyTorch head; acceptance per depth on held-out prompts through the runtime
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ..errors import ExportError, SourceNotFoundError, UsageError
from ..tokenizer import sha256_file
from ..ui import Reporter
from .train import TrainConfig, load_checkpoint

if TYPE_CHECKING:
    from .data import Shard
    from .eagle import EagleHead, HeadConfig
    from .evaluate import Prompt

__all__ = ["TrainDraftRequest", "run_train_draft"]

# fixed once data exists
DATA_KEYS = ("arch", "batch", "max_new", "seed", "prompts", "val_prompts", "corpus", "corpus_window", "features_from")
RESERVE_S = 120.0  # time kept back from training for export and validation


@dataclass
class TrainDraftRequest:
    target: str  # recipe name or export folder (float32 target)
    out: Path | None = None
    arch: str = "eagle"
    tokens: int = 300_000  # target-generated answer tokens to train on
    time_budget: float | None = None  # minutes for this run
    resume: bool = False
    source: str | None = None  # PyTorch checkpoint / GGUF of the target (default: from its manifest)
    batch: int = 64
    max_new: int = 128
    prompts: int | None = None  # use only the first N training prompts (tests)
    val_prompts: int = 96
    epochs: float = TrainConfig.epochs
    depth: int = TrainConfig.depth
    vocab_size: int = 8192
    batch_tokens: int = TrainConfig.batch_tokens
    lr: float = TrainConfig.lr
    eval_every: int = TrainConfig.eval_every
    eval_prompts: int = 14
    eval_k: int = 4
    eval_new_tokens: int = 64
    seed: int = 0
    threads: int | None = None
    device: str = "auto"  # PyTorch device for data generation and training: auto = cuda if present
    corpus: str | None = None  # teacher-forced text sources (export.draft.corpus.SOURCES), comma-separated
    corpus_tokens: int = 1_000_000  # teacher-forced positions to build from the corpus
    corpus_window: int = 512  # tokens per corpus window
    corpus_shard: int = 32  # windows per corpus shard
    features_from: str | None = None  # export folder or recipe of the copy the head drafts for (int8/int4)


def _target_dirs(req: TrainDraftRequest, ui: Reporter) -> tuple[Path, str]:
    """(built target folder, PyTorch source path) for a recipe name or an export folder."""
    from ..recipes import fetch_source, find_recipe, load_recipe

    path = Path(req.target).expanduser()
    if (path / "manifest.json").is_file():
        folder = path
    else:
        recipe = find_recipe(req.target)
        if recipe is None:
            raise SourceNotFoundError(f"--target {req.target}: not an export folder or a recipe")
        from ..pipeline import Request, run

        folder = run(Request(src=req.target), ui).out  # a no-op when already built
    manifest = json.loads((folder / "manifest.json").read_text())
    if manifest["onnx"].get("quantization"):
        raise UsageError(
            f"--target {folder}: a quantized target; pass the float32 one as --target and this one as --features-from"
        )
    if req.source:
        return folder, req.source
    src = manifest.get("source", {})
    if src.get("kind") == "recipe":
        found = find_recipe(src["recipe"])
        if found is None:
            raise SourceNotFoundError(f"{folder}: its manifest names recipe {src['recipe']!r}, which is not known")
        return folder, str(fetch_source(load_recipe(found)["target"]))
    if src.get("path"):
        return folder, src["path"]
    raise UsageError(f"{folder}: its manifest does not say where its weights came from; pass --source")


def _prompts(req: TrainDraftRequest, codec: Any) -> tuple[list[list[int]], list[list[int]]]:
    from .prompts import split_of, training_prompts

    allp = training_prompts(req.seed)
    train = [p for p in allp if split_of(p) == "train"][: req.prompts]
    val = [p for p in allp if split_of(p) == "val"][: req.val_prompts]
    enc = (lambda p: codec.encode_prompt([{"role": "user", "content": p}])) if codec.chat_template else codec.encode
    return [enc(p) for p in train], [enc(p) for p in val]


def _eval_prompts(n: int) -> list[Prompt]:
    """Held-out prompts (the benchmark set, never trained on), chat first."""
    import importlib.resources

    lines = importlib.resources.files("specdec_rt.tooling.data").joinpath("prompts.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in lines if x.strip()]
    rows.sort(key=lambda r: r["category"] != "chat")
    messages: list[Prompt] = [r["messages"] for r in rows[:n]]
    return messages


def _state(work: Path, req: TrainDraftRequest) -> dict[str, Any]:
    """The run's fixed settings; a resumed run must match them."""
    path = work / "run.json"
    mine = {k: getattr(req, k) for k in DATA_KEYS}
    if path.exists():
        saved: dict[str, Any] = json.loads(path.read_text())
        if not req.resume:
            raise UsageError(f"{work.parent} holds a run already; pass --resume to continue it or choose another --out")
        diff = [k for k in DATA_KEYS if saved["settings"].get(k, getattr(TrainDraftRequest, k)) != mine[k]]
        if diff:
            raise UsageError(
                f"--resume with different {', '.join(diff)} than the saved run "
                "(" + ", ".join(f"{k}={saved['settings'].get(k, getattr(TrainDraftRequest, k))}" for k in diff) + ")"
            )
        return saved
    work.mkdir(parents=True, exist_ok=True)
    saved = {"settings": mine, "request": {k: str(v) for k, v in asdict(req).items()}}
    path.write_text(json.dumps(saved, indent=1))
    return saved


@dataclass(kw_only=True)
class _Run:
    """One run's fixed facts, shared by the stages."""

    req: TrainDraftRequest
    ui: Reporter
    folder: Path  # the target's export folder
    source: str  # its PyTorch checkpoint / GGUF
    out: Path
    deadline: float | None  # time.monotonic() at which --time-budget ends
    device: str
    tm: Any  # the target's manifest
    codec: Any  # its TextCodec
    features: Path | None = None  # --features-from: the export the head reads features from

    @property
    def work(self) -> Path:
        return self.out / "work"

    @property
    def shards(self) -> Path:
        """The training and validation shards: the float32 target's, or --features-from's."""
        return self.work / ("features" if self.features else "data")

    @property
    def runtime_target(self) -> Path:
        """The target the head drafts for at run time (validation measures acceptance on it)."""
        return self.features or self.folder


def run_train_draft(req: TrainDraftRequest, ui: Reporter | None = None) -> dict[str, Any]:
    """Run (or resume) every stage; returns the report (also written to OUT/report.json)."""
    run = _open_run(req, ui or Reporter())
    report: dict[str, Any] = {"target": str(run.folder), "out": str(run.out)}
    stopped = _data_stage(run)
    if stopped is None and run.req.corpus:
        stopped = _corpus_stage(run, report)
    if stopped is None and run.features is not None:
        report["features_from"] = str(run.features)
        stopped = _features_stage(run, run.features)
    trained = stopped if stopped is not None else _train_stage(run, report)
    if isinstance(trained, str):
        return _stopped(run.out, report, trained, run.ui)
    draft = _export_stage(run, report, trained)
    _validate_stage(run, report, trained=trained, draft=draft)
    report["status"] = "done"
    _write_report(run.out, report, run.ui)
    return report


def _open_run(req: TrainDraftRequest, ui: Reporter) -> _Run:
    """Check the request, find the target, create or check the work folder, set up PyTorch."""
    if req.arch != "eagle":
        raise UsageError(f"--arch {req.arch}: only 'eagle' is built (see docs/train-draft.md)")
    if req.corpus:
        from .corpus import parse_sources

        parse_sources(req.corpus)  # a misspelt source fails before any work
    deadline = None if req.time_budget is None else time.monotonic() + 60.0 * req.time_budget
    folder, source = _target_dirs(req, ui)
    out = Path(req.out or folder.parent / f"{folder.name}-eagle").expanduser().absolute()
    _state(out / "work", req)
    import torch

    torch.set_num_threads(req.threads or torch.get_num_threads())
    device = ("cuda" if torch.cuda.is_available() else "cpu") if req.device == "auto" else req.device
    ui.log(f"PyTorch device: {device}")
    from specdec_rt.ort.manifest import load_manifest
    from specdec_rt.text.codec import TextCodec

    tm = load_manifest(folder)
    features = _features_dir(req.features_from, tm) if req.features_from else None
    return _Run(
        req=req,
        ui=ui,
        folder=folder,
        source=source,
        out=out,
        deadline=deadline,
        device=device,
        tm=tm,
        codec=TextCodec.from_manifest(tm),
        features=features,
    )


def _features_dir(name_or_path: str, tm: Any) -> Path:
    """The export folder ``--features-from`` names; it must be a copy of the target (same
    tokenizer, vocabulary and hidden size) whose graph outputs hidden states."""
    from specdec_rt.errors import ModelLoadError
    from specdec_rt.ort.manifest import load_manifest, resolve_model_dir

    try:
        fm = load_manifest(resolve_model_dir(name_or_path))
    except ModelLoadError as e:
        raise UsageError(f"--features-from {name_or_path}: {e}") from e
    differs = [
        what
        for what, mine, theirs in (
            ("tokenizer", tm.tokenizer_sha256, fm.tokenizer_sha256),
            ("vocab_size", tm.vocab_size, fm.vocab_size),
            ("hidden_size", tm.hidden_size, fm.hidden_size),
        )
        if mine != theirs
    ]
    if differs:
        raise UsageError(f"--features-from {name_or_path}: not a copy of the target (different {', '.join(differs)})")
    if not fm.outputs.get("hidden"):
        raise UsageError(f"--features-from {name_or_path}: its graph has no hidden_states output")
    return fm.folder


def _data_stage(run: _Run) -> str | None:
    """The target's answers to the training prompts (validation first: training needs it from
    the first evaluation). Returns why it stopped, or None when the answer data is complete."""
    from .data import generate_shards

    req, work, ui = run.req, run.work, run.ui
    data_done = work / "data" / "done.json"
    if data_done.exists():
        return None
    train_ids, val_ids = _prompts(req, run.codec)
    with ui.stage("load the target in PyTorch (data generation)"):
        model = _load_torch(run.source).to(run.device)
    eos = set(run.tm.eos_ids) or {0}
    with ui.stage(f"data: {len(val_ids)} validation answers"):
        generate_shards(
            model,
            val_ids,
            work / "data" / "val",
            batch=req.batch,
            max_new=req.max_new,
            eos=eos,
            tokens_goal=10**12,
            deadline=run.deadline,
            log=ui.log,
        )
    with ui.stage(f"data: training answers, goal {req.tokens:,} tokens"):
        have = generate_shards(
            model,
            train_ids,
            work / "data" / "train",
            batch=req.batch,
            max_new=req.max_new,
            eos=eos,
            tokens_goal=req.tokens,
            deadline=run.deadline,
            log=ui.log,
        )
    del model
    n_val = len(list((work / "data" / "val").glob("shard-?????.npz")))
    if run.deadline is not None and time.monotonic() > run.deadline or n_val < -(-len(val_ids) // req.batch):
        return f"time budget reached during data generation ({have:,} of {req.tokens:,} tokens); rerun with --resume"
    data_done.write_text(json.dumps({"answer_tokens": have}))
    return None


def _corpus_stage(run: _Run, report: dict[str, Any]) -> str | None:
    """Collect the corpus once (``work/corpus``), then write teacher-forced shards
    (``work/data/corpus``) up to ``--corpus-tokens`` positions. Returns why it stopped, or
    None when the corpus data is complete."""
    from .corpus import corpus_shards

    corpus = _collect_corpus(run, report)
    done = run.work / "data" / "corpus-done.json"
    if done.exists():
        return None
    with run.ui.stage("load the target in PyTorch (teacher forcing)"):
        model = _load_torch(run.source).to(run.device)
    goal = min(run.req.corpus_tokens, corpus.positions)
    with run.ui.stage(f"corpus: teacher-forced shards, goal {goal:,} positions"):
        have = corpus_shards(
            model,
            corpus,
            run.work / "data" / "corpus",
            per_shard=run.req.corpus_shard,
            positions_goal=goal,
            deadline=run.deadline,
            log=run.ui.log,
        )
    if have < goal:
        return (
            f"time budget reached during corpus teacher forcing ({have:,} of {goal:,} positions); rerun with --resume"
        )
    done.write_text(json.dumps({"positions": have}))
    return None


def _collect_corpus(run: _Run, report: dict[str, Any]) -> Any:
    """The corpus windows, collected on the first run and read back on a resumed one; the
    per-source record goes to the report and the log."""
    from .corpus import CorpusSpec, build_corpus, load_corpus, parse_sources, save_corpus

    folder = run.work / "corpus"
    corpus = load_corpus(folder)
    if corpus is None:
        names = tuple(parse_sources(run.req.corpus or ""))
        spec = CorpusSpec(
            sources=names, window=run.req.corpus_window, max_tokens_per_source=run.req.corpus_tokens, seed=run.req.seed
        )
        with run.ui.stage(f"corpus: collect {', '.join(names)}"):
            corpus = build_corpus(spec, run.codec.encode)
            save_corpus(folder, corpus)
    report["corpus"] = {
        "sources": json.loads((folder / "sources.json").read_text()),
        "windows": len(corpus),
        "positions_available": corpus.positions,
    }
    for st in corpus.stats:
        run.ui.log(
            f"corpus: {st.name}: {st.files:,} files, {st.bytes:,} bytes, {st.tokens:,} tokens kept, "
            f"{st.duplicates} duplicate and {st.benchmark_overlap} benchmark-overlapping windows dropped"
        )
    return corpus


def _features_stage(run: _Run, features: Path) -> str | None:
    """Every answer and corpus shard read again by the ``--features-from`` export: its hidden
    states and top-k labels replace the float32 target's (``work/features``). Returns why it
    stopped, or None when complete."""
    from .relabel import open_features_model, relabel_shards

    done = run.work / "features" / "done.json"
    if done.exists():
        return None
    length = max(2048, run.req.corpus_window + 1, run.req.max_new + 1024)
    with run.ui.stage(f"features: load {features} (ONNX Runtime)"):
        model = open_features_model(features, max_length=length, threads=run.req.threads)
    try:
        for part in ("val", "train", "corpus"):
            src = run.work / "data" / part
            if not src.is_dir():
                continue
            with run.ui.stage(f"features: {part} shards read by {features.name}"):
                if not relabel_shards(model, src, run.work / "features" / part, deadline=run.deadline, log=run.ui.log):
                    return f"time budget reached while reading features ({part} shards); rerun with --resume"
    finally:
        model.close()
    done.write_text(json.dumps({"features_from": str(features)}))
    return None


@dataclass(kw_only=True)
class _Trained:
    """What training leaves for the export and validation stages."""

    head: Any  # the PyTorch EagleHead
    cfg: Any  # its HeadConfig
    vocab: np.ndarray
    summary: dict[str, Any]
    val_shards: list[Any]


def _train_stage(run: _Run, report: dict[str, Any]) -> _Trained | str:
    """Train the head on the answer shards (and the corpus shards). Returns the trained head,
    or why it stopped."""
    from .data import load_shards
    from .train import make_batches, reduced_vocab, train

    req, work, tm = run.req, run.work, run.tm
    train_sh, val_sh = load_shards(run.shards / "train"), load_shards(run.shards / "val")
    report["train_answer_tokens"] = sum(s.answer_tokens for s in train_sh)
    report["train_sequences"] = sum(len(s.prompt_lens) for s in train_sh)
    corpus_sh = load_shards(run.shards / "corpus") if req.corpus else []
    if req.corpus:
        report["corpus"]["positions_used"] = sum(s.answer_tokens for s in corpus_sh)
    vocab_path = work / "vocab.npy"
    if not vocab_path.exists():  # the answers and the corpus weigh the same in the vocabulary
        vocab = reduced_vocab(train_sh, req.vocab_size, list(tm.eos_ids), more=[corpus_sh] if corpus_sh else [])
        np.save(vocab_path, vocab)
    train_sh = train_sh + corpus_sh
    vocab = np.load(vocab_path)
    cover = _coverage(val_sh, vocab)
    run.ui.log(
        f"train: reduced vocabulary {vocab.size} tokens covers {cover:.2%} of the target's validation argmax tokens"
    )
    head, cfg = _new_head(run.folder, tm, vocab)
    head.to(run.device)
    with run.ui.stage("train: batches"):
        train_b = make_batches(train_sh, vocab, req.batch_tokens, tm.vocab_size)
        val_b = make_batches(val_sh, vocab, req.batch_tokens, tm.vocab_size)
    tcfg = TrainConfig(
        depth=req.depth,
        lr=req.lr,
        epochs=req.epochs,
        batch_tokens=req.batch_tokens,
        seed=req.seed,
        eval_every=req.eval_every,
    )
    budget_end = None if run.deadline is None else run.deadline - min(RESERVE_S, 0.2 * 60 * (req.time_budget or 0))
    with run.ui.stage(f"train: {len(train_b)} batches x {req.epochs} epochs, depth {req.depth}"):
        stop = None if budget_end is None else (lambda: time.monotonic() > budget_end)
        summary = train(head, train_b, val_b, tcfg, work=work, should_stop=stop, log=run.ui.log)
    report["training"] = {k: v for k, v in summary.items() if k != "curve"}
    report["curve"] = summary["curve"]
    report["vocab"] = {"size": int(vocab.size), "val_argmax_coverage": round(cover, 5)}
    if summary["stopped"] != "done":
        return f"time budget reached at training step {summary['step']}/{summary['total_steps']}; rerun with --resume"
    return _Trained(head=head, cfg=cfg, vocab=vocab, summary=summary, val_shards=val_sh)


def _export_stage(run: _Run, report: dict[str, Any], trained: _Trained) -> Path:
    """``head.npz`` (the best checkpoint, float16), then the ONNX draft folder assembled with
    the target; the PyTorch head is left holding the shipped float16 weights."""
    from .assemble import assemble_draft, save_head

    head, summary = trained.head, trained.summary
    head.load_state_dict(load_checkpoint(run.work / "best.pt"), strict=False)
    head.to("cpu")
    training = {
        "answer_tokens": report["train_answer_tokens"],
        "corpus_positions": report.get("corpus", {}).get("positions_used", 0),
        "steps": summary["step"],
        "depth": run.req.depth,
        "val_top1": summary["curve"][-1]["val"],
        "best_val_top1_depth1": summary["best_val_top1"],
    }
    head_file = save_head(
        run.out / "head.npz",
        _weights(head),
        trained.vocab,
        {**trained.cfg.to_dict(), "target_vocab_size": run.tm.vocab_size, "training": training},
    )
    _load_weights(head, head_file)  # the shipped float16 weights: what the ONNX draft computes
    draft = run.out / "draft"
    shutil.rmtree(draft, ignore_errors=True)
    head_sha = sha256_file(head_file)
    with run.ui.stage("export: assemble the ONNX draft"):
        assemble_draft(
            run.folder, head_file, draft, source={"kind": "trained head", "file": "head.npz", "sha256": head_sha}
        )
    report["head_file"] = {"path": str(head_file), "bytes": head_file.stat().st_size, "sha256": head_sha}
    return draft


def _validate_stage(run: _Run, report: dict[str, Any], *, trained: _Trained, draft: Path) -> None:
    """The ONNX head against the PyTorch head, then acceptance per depth through the runtime."""
    from .evaluate import measure_acceptance

    with run.ui.stage("validate: ONNX head vs PyTorch head"):
        report["onnx_max_abs_diff"] = _check_onnx(trained.head, draft, trained.val_shards)
    req = run.req
    with run.ui.stage(f"validate: acceptance on {req.eval_prompts} held-out prompts (k={req.eval_k})"):
        report["acceptance"] = measure_acceptance(
            run.runtime_target,
            draft,
            _eval_prompts(req.eval_prompts),
            k=req.eval_k,
            max_new_tokens=req.eval_new_tokens,
            threads=req.threads,
        )
        report["acceptance"]["target"] = str(run.runtime_target)


def _load_torch(source: str) -> Any:
    import torch

    from ..source import open_source

    model = open_source(source).load_model()
    return model.to(torch.float32).eval()


def _new_head(folder: Path, tm: Any, vocab: npt.NDArray[np.int64]) -> tuple[EagleHead, HeadConfig]:
    import torch

    from .assemble import TARGET_TENSORS
    from .eagle import EagleHead, HeadConfig
    from .graph import target_tensors

    t = target_tensors(folder, TARGET_TENSORS)
    intermediate, eps = _graph_facts(folder, tm)
    cfg = HeadConfig(
        hidden_size=tm.hidden_size,
        num_heads=tm.num_heads,
        num_kv_heads=tm.num_kv_heads,
        head_dim=tm.head_dim,
        intermediate_size=intermediate,
        rms_eps=eps,
        draft_vocab=int(vocab.size),
    )
    torch.manual_seed(0)  # the head's initial weights do not depend on what ran before
    # float16-rounded, as the ONNX draft stores it: training sees what inference computes
    embed = torch.from_numpy(t["embed_tokens.weight"].astype(np.float16).astype(np.float32))
    lm = torch.from_numpy(np.ascontiguousarray(t["lm_head.weight"][:, vocab].T))  # [V', H]
    head = EagleHead(
        cfg,
        embed,
        lm,
        torch.from_numpy(t["cos_cache"]),
        sin=torch.from_numpy(t["sin_cache"]),
        norm_weight=torch.from_numpy(t["norm.weight"].copy()),
    )
    return head, cfg


def _graph_facts(folder: Path, tm: Any) -> tuple[int, float]:
    """The target's MLP width and RMSNorm epsilon, read off its graph (one parse): the head's
    layer copies the target's shape."""
    import onnx

    proto = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    width = next(
        (int(t.dims[1]) for t in proto.graph.initializer if t.name == "layers.0/mlp/gate_proj.weight"),
        4 * tm.hidden_size,
    )
    eps = next(
        (
            float(next(a.f for a in n.attribute if a.name == "epsilon"))
            for n in proto.graph.node
            if n.op_type in ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")
        ),
        1e-6,
    )
    return width, eps


def _weights(head: EagleHead) -> dict[str, np.ndarray]:
    from .graph import HEAD_KEYS

    sd = head.state_dict()
    return {k: sd[f"{k}.weight"].detach().float().numpy() for k in HEAD_KEYS}


def _load_weights(head: EagleHead, head_file: Path) -> None:
    import torch

    from .assemble import load_head

    weights, _, _ = load_head(head_file)
    head.load_state_dict({f"{k}.weight": torch.from_numpy(w) for k, w in weights.items()}, strict=False)


def _coverage(shards: list[Shard], vocab: npt.NDArray[np.int64]) -> float:
    top = np.concatenate([s.topk_ids[:, 0] for s in shards]) if shards else np.zeros(0, np.int64)
    return float(np.isin(top, vocab).mean()) if top.size else float("nan")


def _check_onnx(head: EagleHead, draft: Path, val_sh: list[Shard]) -> float:
    """Max |logit| difference between the ONNX draft and the PyTorch head on one sequence,
    fed in two chunks (prefill, then one step) to exercise the KV cache."""
    import anyio
    import torch

    from specdec_rt.ort import OrtModel

    tok, _, feats, _, _ = next(val_sh[0].sequences())
    n = min(len(tok) - 1, 24)
    m = OrtModel(draft, slots=1, max_length=64)
    s = m.start()

    async def go() -> npt.NDArray[np.float32]:
        a, _ = await s.extend(tok[1:n].astype(np.int64), n - 1, features=feats[: n - 1].astype(np.float32), hidden=True)
        b, _ = await s.extend(
            tok[n : n + 1].astype(np.int64), 1, features=feats[n - 1 : n].astype(np.float32), hidden=True
        )
        return np.concatenate([a, b])

    got = anyio.run(go)
    s.close()
    m.close()
    g, _ = head.step(
        torch.from_numpy(tok[1 : n + 1].astype(np.int64)), torch.from_numpy(feats[:n].astype(np.float32)), None, 0
    )
    ref = head.logits(g).numpy()
    diff = float(np.abs(got - ref).max())
    if not diff < 1e-2 * max(1.0, float(np.abs(ref).max())):
        raise ExportError(f"the ONNX draft disagrees with the PyTorch head: max |dlogit| {diff:.3g}")
    return diff


def _stopped(out: Path, report: dict[str, Any], why: str, ui: Reporter) -> dict[str, Any]:
    report["status"] = "stopped"
    report["why"] = why
    ui.log(why)
    _write_report(out, report, ui)
    return report


def _write_report(out: Path, report: dict[str, Any], ui: Reporter) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    if report.get("curve"):
        try:
            from .plot import plot_curve

            plot_curve(report, out / "curve.png")
        except ImportError:
            ui.log("matplotlib not installed: no curve.png (pip install .[export])")
